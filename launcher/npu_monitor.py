"""NPU health while training: ``npu-smi info`` every N seconds into a JSON-lines file, warnings once.

Host side, once per node, beside msrun: one line per NPU and sample with health, temperature, power,
AICore % and HBM used/total. Each condition warns once per NPU: temperature at or above 85 C, health
not OK, HBM above 97% full, and AICore below 30% for several samples in a row while the NPU holds most
of its HBM (the model is loaded, so the chip waits for the host: data, host syncs, CPU binding).
Off on hosts without NPUs or npu-smi, and says so.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from jobspec.rundir import RunDir
from launcher.devices import Devices
from launcher.npu_smi import NpuRow, NpuSmi, parse_info


@dataclass(frozen=True)
class Limits:
    """When to warn; tests move them across recorded values."""

    temp_c: float = 85.0
    hbm_frac: float = 0.97
    aicore_pct: float = 30.0
    low_samples: int = 5  # consecutive low-AICore samples before "host-bound?"
    loaded_frac: float = 0.5  # HBM share above which the model counts as loaded
    healthy: tuple[str, ...] = ("OK",)


class NpuMonitor:
    """Samples ``npu-smi info`` for ``npus`` and appends to ``path``; ``warn`` gets each warning once."""

    def __init__(self, path: Path, npus: list[int], npu_smi: NpuSmi, warn: Callable[[str], None],
                 limits: Limits = Limits(), clock: Callable[[], float] = time.time):
        self.path, self.npus, self.npu_smi, self.warn = path, set(npus), npu_smi, warn
        self.limits, self.clock = limits, clock
        self.warned: set[tuple[int, str]] = set()
        self.low: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> list[dict]:
        """One ``npu-smi info``: a record per watched NPU, appended to the file, conditions checked."""
        text = self.npu_smi(["info"])
        rows = [r for r in parse_info(text).values() if r.npu in self.npus] if text else []
        now = round(self.clock(), 3)
        records = [{"time": now, "npu": r.npu, "health": r.health, "temp_c": r.temp_c, "power_w": r.power_w,
                    "aicore_pct": r.aicore_pct, "hbm_used_mb": r.hbm_used_mb, "hbm_total_mb": r.hbm_total_mb}
                   for r in rows]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.writelines(json.dumps(rec) + "\n" for rec in records)
        for r in rows:
            for key, msg in self._conditions(r):
                if (r.npu, key) not in self.warned:
                    self.warned.add((r.npu, key))
                    self.warn(f"NPU {r.npu}: {msg}")
        return records

    def _conditions(self, r: NpuRow) -> Iterator[tuple[str, str]]:
        lim = self.limits
        if r.health not in lim.healthy:
            yield "health", f"npu-smi health {r.health}; check `npu-smi info -t health -i {r.npu}`"
        if r.temp_c is not None and r.temp_c >= lim.temp_c:
            yield "temp", f"temperature {r.temp_c:.0f} C >= {lim.temp_c:.0f} C; check the server's cooling"
        hbm = r.hbm_used_mb / r.hbm_total_mb if r.hbm_used_mb is not None and r.hbm_total_mb else None
        if hbm is not None and hbm > lim.hbm_frac:
            yield "hbm", (f"HBM {r.hbm_used_mb}/{r.hbm_total_mb} MB ({hbm:.1%}) near full; lower "
                          "train.micro_batch_size or turn on train.recompute before it runs out")
        low = r.aicore_pct is not None and r.aicore_pct < lim.aicore_pct and hbm is not None and hbm > lim.loaded_frac
        self.low[r.npu] = self.low.get(r.npu, 0) + 1 if low else 0
        if self.low[r.npu] >= lim.low_samples:
            yield "aicore", (f"AICore {r.aicore_pct:.0f}% for {self.low[r.npu]} samples in a row with the model "
                             "loaded: host-bound? (data loading, host syncs, CPU binding: see plan.json binding)")

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.sample()

    def start(self, interval_s: float) -> NpuMonitor:
        self._thread = threading.Thread(target=self._run, args=(interval_s,), name="npu-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


@contextmanager
def running(devices: Devices, out: Path, node_rank: int, interval_s: float, npu_smi: NpuSmi | None,
            log: Callable[[str], None]) -> Iterator[NpuMonitor | None]:
    """The monitor around a training run (``with running(...):``); None, said in the log, when it is off."""
    why = ("no NPU on this host" if not devices.visible else "npu-smi not available" if npu_smi is None
           or npu_smi(["info"]) is None else "launch.npu_monitor_s=0" if interval_s <= 0 else "")
    if why:
        log(f"NPU monitor: off ({why})")
        yield None
        return
    path = RunDir(out).npu_log(node_rank)
    log(f"NPU monitor: npu-smi every {interval_s:g} s into {path}")
    assert npu_smi is not None  # why above says so otherwise
    mon = NpuMonitor(path, devices.visible, npu_smi, lambda m: log(f"warning: {m}")).start(interval_s)
    try:
        yield mon
    finally:
        mon.stop()
