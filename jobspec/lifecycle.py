"""A worker's life as the launcher sees it: die with the parent, and one status file per rank.

``<output_dir>/logs/ranks/rank_00001.json`` is written when the rank starts (pid, host) and when it
ends (exit code and, after an exception, its type, message and traceback). The launcher reads
these files to name the failing rank and its error instead of searching logs for "Error".
Pure Python (no mindspore): the launcher imports it for the file format.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jobspec.fsutil import pid_alive
from jobspec.rundir import RunDir

PR_SET_PDEATHSIG = 1
LAUNCHER_PID_ENV = "AF_LAUNCHER_PID"


class PeerLost(RuntimeError):
    """A rank cannot go on because another process of the job is gone: a consequence, not the cause.

    The launcher names any other failure first: a peer killed by a signal leaves no exit record, so the
    launcher only knows when it noticed that death, often after this rank has recorded its own exit."""


class DeviceOutOfMemory(RuntimeError):
    """A device allocation failed (finetune/run/memcheck.py names where, the plan's estimate and what shrinks it).
    The launcher does not restart the job after it: the same layout and recipe run out again."""


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies; False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def die_with_parent() -> None:
    """SIGKILL this process when its parent exits; exit now if the launcher is already gone.

    The launcher's pid comes from ``AF_LAUNCHER_PID``; checked after the prctl so a launcher that
    died in between is not missed.
    """
    set_parent_death_signal(signal.SIGKILL)
    pid = os.environ.get(LAUNCHER_PID_ENV, "")
    if os.getppid() == 1 or (pid.isdigit() and not pid_alive(int(pid))):
        os._exit(137)


def log_dir(output_dir: str | Path) -> Path:
    """Where msrun's worker logs and the rank status files go."""
    return Path(RunDir(output_dir).logs)


def status_dir(log_dir: str | Path) -> Path:
    return Path(log_dir) / "ranks"


def status_path(log_dir: str | Path, rank: int) -> Path:
    return status_dir(log_dir) / f"rank_{rank:05d}.json"


def write_status(path: Path, record: dict[str, Any]) -> None:
    """Atomic: a reader sees the old or the new record, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)


def read_statuses(log_dir: str | Path, since: float = 0.0) -> dict[int, dict[str, Any]]:
    """rank -> its latest record, for ranks started at or after ``since`` (a unix time)."""
    out = {}
    for p in status_dir(log_dir).glob("rank_*.json"):
        try:
            r = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if r.get("started_at", 0) >= since:
            out[int(r["rank"])] = r
    return out


class RankStatus:
    """``start()`` when the rank begins, ``finish(code, exc)`` when it ends."""

    def __init__(self, log_dir: str | Path, rank: int):
        self.path = status_path(log_dir, rank)
        self.record = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "started_at": time.time(),
                       "state": "running"}

    def start(self) -> None:
        write_status(self.path, self.record)

    def finish(self, code: int, exc: BaseException | None = None) -> None:
        self.record.update(state="exited", exit_code=code, ended_at=time.time())
        if exc is not None:
            self.record["error"] = {"type": type(exc).__name__, "message": str(exc),
                                    "traceback": "".join(traceback.format_exception(exc))}
        write_status(self.path, self.record)


def run_rank(log_dir: str | Path, rank: int, main: Callable[[], int]) -> int:
    """Run ``main()`` as rank ``rank`` with its status file; an exception is one line on stderr naming the
    status file, which holds its traceback; exit 1."""
    status = RankStatus(log_dir, rank)
    status.start()
    try:
        code = int(main() or 0)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        status.finish(code)
        raise
    except BaseException as e:  # recorded for the launcher: one line here, the traceback in the file
        status.finish(1, e)
        print(f"[rank {rank}] error: {type(e).__name__}: {e} (traceback in {status.path})", file=sys.stderr,
              flush=True)
        return 1
    status.finish(code)
    return code
