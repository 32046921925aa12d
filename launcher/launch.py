"""msrun argv, the workers' environment, plan.json, and supervision (signals, restarts, log tails)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import psutil

from finetune.config import REPO_ROOT, Recipe

WORKER_SCRIPT = REPO_ROOT / "finetune" / "worker.py"
# CANN's defaults are 120 s (connect) and 1836 s (exec, Atlas A2: CANN env var reference, HCCL_EXEC_TIMEOUT);
# the connect wait is raised for multi-node start-up, the exec wait is never set below CANN's.
HCCL_DEFAULTS = {"HCCL_CONNECT_TIMEOUT": "1200", "HCCL_EXEC_TIMEOUT": "1836"}
HCCL_PASSTHROUGH = ("HCCL_IF_IP", "HCCL_SOCKET_IFNAME", "HCCL_BUFFSIZE")
FAILURE_MARKERS = ("Traceback", "Error", "error:", "Killed", "core dumped")


def msrun_argv(recipe: Recipe, nproc: int, plan_path: Path, log_dir: Path,
               worker_script: Path = WORKER_SCRIPT, msrun: str | None = None) -> list[str]:
    """The msrun command as an argument list (never a shell string); the venv's msrun when present."""
    L = recipe.launch
    venv_msrun = Path(sys.executable).parent / "msrun"
    msrun = msrun or (str(venv_msrun) if venv_msrun.exists() else "msrun")
    return [msrun, "--worker_num", str(L.nnodes * nproc), "--local_worker_num", str(nproc),
            "--master_addr", L.master_addr, "--master_port", str(L.master_port), "--node_rank", str(L.node_rank),
            "--log_dir", str(log_dir), "--join", "True", "--cluster_time_out", str(L.cluster_time_out),
            str(worker_script), "--config", str(plan_path)]


def direct_argv(plan_path: Path, worker_script: Path = WORKER_SCRIPT, python: str = sys.executable) -> list[str]:
    """World size 1: the worker alone, no msrun scheduler process."""
    return [python, str(worker_script), "--config", str(plan_path)]


def worker_env(base: Mapping[str, str], extra: Mapping[str, str], python: str = sys.executable) -> dict[str, str]:
    """The environment every worker gets: venv bin first on PATH, repo on PYTHONPATH, HCCL defaults."""
    env = dict(base)
    bin_dir = str(Path(python).parent)
    env["PATH"] = os.pathsep.join([bin_dir] + [p for p in env.get("PATH", "").split(os.pathsep) if p and p != bin_dir])
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                             if p and p != str(REPO_ROOT)])
    env["PYTHONUNBUFFERED"] = "1"
    for k, v in HCCL_DEFAULTS.items():
        if not env.get(k):
            env[k] = v
    env.update(extra)
    return env


def set_vars(env: Mapping[str, str], base: Mapping[str, str]) -> dict[str, str]:
    """The variables the launcher sets or changes for workers (for the plan and the log)."""
    keep = set(HCCL_PASSTHROUGH)
    return {k: v for k, v in sorted(env.items()) if base.get(k) != v or (k in keep and v)}


def write_plan(path: Path, plan: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(plan, indent=2, default=str))
    tmp.replace(path)


def failing_rank(log_dir: Path, since: float = 0.0) -> tuple[int, Path] | None:
    """The first rank whose worker_<rank>.log shows a failure (earliest written), else None."""
    found = []
    for p in log_dir.glob("worker_*.log"):
        stem = p.stem.split("_", 1)[1]
        if not stem.isdigit() or p.stat().st_mtime < since:
            continue
        text = p.read_text(errors="replace")
        if any(m in text for m in FAILURE_MARKERS):
            found.append((p.stat().st_mtime, int(stem), p))
    if not found:
        return None
    _, rank, path = min(found)
    return rank, path


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _descendants(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _kill(fn: Callable[[], None]) -> None:
    try:
        fn()
    except (ProcessLookupError, PermissionError):
        pass


def _tee(proc: subprocess.Popen, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        for line in iter(proc.stdout.readline, b""):
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
            f.write(line)
            f.flush()


def supervise(argv: list[str], env: Mapping[str, str], log_dir: Path, max_restarts: int, cwd: Path | None = None,
              log: Callable[[str], None] = print, restart_delay_s: float = 1.0, tee_to: Path | None = None,
              signal_workers_only: bool = False) -> int:
    """Run argv in its own process group; forward SIGTERM/SIGINT; restart up to max_restarts times.

    Each restart relaunches the same command: the workers resume from the newest checkpoint
    (train.resume=auto). ``tee_to``: also copy the output to this file (a worker run without msrun).
    Returns the job's exit code.
    """
    attempt, stopping = 0, {"sig": None}
    proc: subprocess.Popen | None = None

    def forward(signum, _frame):
        stopping["sig"] = signum
        if proc is None or proc.poll() is not None:
            return
        kids = _descendants(proc.pid) if signal_workers_only else []
        for pid in kids:
            _kill(lambda: os.kill(pid, signum))
        if not kids:
            _kill(lambda: os.killpg(proc.pid, signum))

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            started = time.time()
            proc = subprocess.Popen(argv, env=dict(env), cwd=cwd, start_new_session=True,
                                    stdout=subprocess.PIPE if tee_to else None,
                                    stderr=subprocess.STDOUT if tee_to else None)
            if tee_to:
                _tee(proc, tee_to)
            rc = proc.wait()
            if rc == 0 or stopping["sig"] is not None:
                if stopping["sig"] is not None:
                    log(f"stopped by signal {signal.Signals(stopping['sig']).name}; exit code {rc}")
                return rc
            bad = failing_rank(log_dir, since=started - 1)
            if bad:
                log(f"worker failed (exit code {rc}); first failing rank: {bad[0]} ({bad[1]}), last lines:\n"
                    f"{tail(bad[1])}")
            else:
                log(f"worker failed (exit code {rc}); no worker log under {log_dir} shows the error")
            if attempt >= max_restarts:
                if max_restarts:
                    log(f"giving up after {max_restarts} restart(s)")
                return rc
            attempt += 1
            log(f"restart {attempt}/{max_restarts}: resuming from the newest checkpoint")
            time.sleep(restart_delay_s)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
