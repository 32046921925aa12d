"""Run real msrun jobs from tests: free port, venv bin first on PATH, logs shown on failure."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from msrun_helpers import free_port

REPO = Path(__file__).resolve().parents[3]
VENV_BIN = Path(sys.executable).parent


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"  # msrun starts workers with bare `python`
    env["PYTHONPATH"] = str(REPO)
    env.setdefault("GLOG_v", "3")  # MindSpore: errors only
    return env


def _log_tail(log_dir: Path, n: int = 3000) -> str:
    out = []
    for f in sorted(log_dir.glob("*.log")):
        lines = [ln for ln in f.read_text(errors="replace").splitlines() if "[WARNING]" not in ln]
        out.append(f"--- {f.name}\n" + "\n".join(lines)[-n:])
    return "\n".join(out)


def msrun(script: Path, args: list[str], workers: int, cwd: Path, nodes: int = 1, timeout: int = 900,
          kill_when: Callable[[], bool] | None = None) -> None:
    """Run ``script args`` in ``workers`` msrun workers (``nodes`` msrun invocations on this machine).

    ``kill_when``: polled every 0.2 s; once true, every msrun, scheduler and worker is SIGKILLed
    (a crash mid-run) and the call returns. Raises AssertionError with the workers' log tails when
    the job fails or times out.
    """
    port = free_port()
    local = workers // nodes
    procs, logs = [], []
    for node in range(nodes):
        log_dir = cwd / f"msrun-logs-{node}"
        logs.append(log_dir)
        cmd = [str(VENV_BIN / "msrun"), "--worker_num", str(workers), "--local_worker_num", str(local),
               "--master_addr", "127.0.0.1", "--master_port", str(port), "--node_rank", str(node),
               "--join", "True", "--log_dir", str(log_dir), str(script), *args]
        with open(cwd / f"msrun-{node}.out", "w") as out:  # a file, not a pipe: nothing blocks on it
            procs.append(subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        if node == 0 and nodes > 1:
            _wait_listening(port, procs[0], timeout)
    if kill_when is not None:
        deadline = time.monotonic() + timeout
        while not kill_when():
            if time.monotonic() > deadline or all(p.poll() is not None for p in procs):
                _kill(procs)
                raise AssertionError("the job ended before the kill point\n" + "\n".join(_log_tail(d) for d in logs))
            time.sleep(0.2)
        _kill(procs)
        return
    failed = []
    for node, p in enumerate(procs):
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(procs)
            failed.append("timeout")
            continue
        text = (cwd / f"msrun-{node}.out").read_text(errors="replace")
        if p.returncode != 0 and not (node > 0 and _only_duplicate_scheduler_failed(text)):
            failed.append(f"rc={p.returncode}: {text[-1500:]}")
    if failed:
        raise AssertionError("msrun failed: " + " | ".join(failed) + "\n" + "\n".join(_log_tail(d) for d in logs))


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float) -> None:
    """Until node 0's scheduler accepts connections, so it (not a later node's) owns the port."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)


def _only_duplicate_scheduler_failed(msrun_out: str) -> bool:
    """On one host every msrun sees master_addr as local and starts a scheduler; a later node's
    cannot bind the port and exits with an error while its workers joined node 0's and finished."""
    return "Scheduler process" in msrun_out and "exit with exception" in msrun_out \
        and "Worker process" not in msrun_out


def _kill(procs: list[subprocess.Popen]) -> None:
    """Stop every msrun with SIGINT (msrun then SIGKILLs its scheduler and workers, which run in
    their own sessions); SIGKILL the msrun process group if it does not exit in time."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def python(script: Path, args: list[str], cwd: Path, timeout: int = 900) -> None:
    """Run ``script args`` as one plain process (the one-process reference)."""
    p = subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                       timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(f"{script.name} failed rc={p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
