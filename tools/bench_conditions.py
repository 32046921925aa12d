"""Pure helpers of the benchmarks: round order, per-path ratio statistics and the machine's conditions
(CPU model and flags, cores, load average) with the check that refuses a ratio on a loaded machine."""
from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from pathlib import Path


def interleave(paths: list[str], rounds: int, reference: str = "torch") -> list[tuple[int, str]]:
    """(round, path) in run order: each of ``paths`` followed by the reference, every round,
    e.g. ours-opbyop, torch, ours-compiled, torch, ... so that drift of the machine hits all alike."""
    return [(r, p) for r in range(rounds) for path in paths for p in (path, reference)]


def by_path(steps: list[tuple[str, float]],
            reference: str = "torch") -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """From timed (path, seconds) in run order: seconds per path, and per path the reference's seconds of
    the step run right after each of its steps (the pair its ratio is taken from)."""
    times: dict[str, list[float]] = {}
    after: dict[str, list[float]] = {}
    prev = ""
    for name, s in steps:
        times.setdefault(name, []).append(s)
        if name == reference and prev and prev != reference:
            after.setdefault(prev, []).append(s)
        prev = name
    return times, after


def ratio_stats(ours: list[float], ref: list[float]) -> dict[str, float]:
    """Median and min/max of the per-pair speed ratios ours/reference from step seconds.

    Pair i is ours[i] against ref[i] (the reference step run right after it); ratio = ref s / ours s."""
    if not ours or len(ours) != len(ref):
        raise ValueError(f"need equal, non-empty step lists, got {len(ours)} and {len(ref)}")
    ratios = [r / o for o, r in zip(ours, ref)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "n": len(ratios)}


def read_loadavg(path: Path = Path("/proc/loadavg")) -> float:
    """The 1-minute load average."""
    return float(path.read_text().split()[0])


def cpu_info(path: Path = Path("/proc/cpuinfo")) -> dict[str, object]:
    """CPU model name, avx512f/avx2 presence and the cores this process may use."""
    model, flags = "unknown", set()
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "avx512f": "avx512f" in flags, "avx2": "avx2" in flags,
            "cores": len(os.sched_getaffinity(0))}


class LoadWatch:
    """Samples the 1-minute load average (``reader``, a seam for tests) before and during a run and
    says why a ratio measured under it is not valid ('' while load <= cores)."""

    def __init__(self, cores: int, reader: Callable[[], float] = read_loadavg):
        self.cores, self.reader, self.samples = cores, reader, []

    def sample(self) -> float:
        self.samples.append(self.reader())
        return self.samples[-1]

    def invalid(self) -> str:
        worst = max(self.samples, default=0.0)
        return f"NOT VALID: load average {worst:.2f} > cores {self.cores}" if worst > self.cores else ""


def _stat_fields(path: Path) -> list[str] | None:
    """The fields of a /proc .../stat file after the command name (state first, then ppid)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()


def other_runnable(own: int, proc: Path = Path("/proc")) -> int:
    """Threads in state R of every process outside ``own``'s process tree (the benchmark and its torch
    worker): the work of others competing for the cores right now."""
    parent: dict[int, int] = {}
    for d in proc.iterdir():
        if d.name.isdigit() and (f := _stat_fields(d / "stat")) is not None:
            parent[int(d.name)] = int(f[1])

    def ours(pid: int) -> bool:
        seen = 0
        while pid > 1 and seen < 64:
            if pid == own:
                return True
            pid, seen = parent.get(pid, 0), seen + 1
        return False

    running = 0
    for pid in parent:
        if not ours(pid):
            for task in (proc / str(pid) / "task").glob("*"):
                f = _stat_fields(task / "stat")
                running += f is not None and f[0] == "R"
    return running


class OtherWork:
    """Samples :func:`other_runnable` every ``every`` seconds in a background thread while the benchmark
    runs; the run is NOT VALID when other processes kept more than ``limit`` threads runnable on average
    (the 1-minute load average counts the benchmark's own threads too: ~2 on an idle 2-core machine)."""

    def __init__(self, sampler: Callable[[], int], limit: float = 0.5, every: float = 0.25):
        import threading

        self.sampler, self.limit, self.every, self.samples = sampler, limit, every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.samples.append(self.sampler())

    def __enter__(self) -> OtherWork:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def mean(self) -> float:
        return statistics.fmean(self.samples) if self.samples else 0.0

    def invalid(self) -> str:
        m = self.mean()
        return (f"NOT VALID: other processes kept {m:.2f} threads runnable on average (> {self.limit})"
                if m > self.limit else "")
