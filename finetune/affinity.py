"""Apply the launcher's per-rank CPU/NUMA binding inside a worker, first thing (no mindspore).

Contract (set by ``launcher.numa.worker_env``; the local rank is msrun's ``DEVICE_ID``, else
``LOCAL_RANK``, else 0):

- ``AF_BIND_MODE``: ``numactl`` | ``affinity`` | ``off`` (unset: off)
- ``AF_CPU_BIND_<local_rank>``: cpulist such as ``0-23`` or ``0-11,48-59``
- ``AF_MEM_BIND_<local_rank>``: NUMA node id for memory (numactl mode)
- ``AF_NUMACTL_<local_rank>``: the numactl options, e.g. ``--cpunodebind=0 --membind=0``

msrun's scheduler process (``MS_ROLE=MS_SCHED``, no ``DEVICE_ID``) is never bound: it is no rank.
numactl mode re-executes the worker once under ``numactl`` (``AF_BOUND=1`` stops a second time);
affinity mode calls ``os.sched_setaffinity``. Failures print a warning and the worker goes on.
"""
from __future__ import annotations

import os
import shutil
import sys
from collections.abc import MutableMapping


def _cpus(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def local_rank(env: MutableMapping[str, str]) -> int:
    """msrun sets DEVICE_ID to the local rank of each worker it starts."""
    for var in ("DEVICE_ID", "LOCAL_RANK"):
        if env.get(var, "").isdigit():
            return int(env[var])
    return 0


def apply_binding(env: MutableMapping[str, str] | None = None, argv: list[str] | None = None) -> str:
    """Bind this process as the launcher planned; returns what was done (for the log)."""
    env = os.environ if env is None else env
    if env.get("MS_ROLE") == "MS_SCHED":
        return "not bound (msrun's scheduler process)"
    mode, rank = env.get("AF_BIND_MODE", "off"), local_rank(env)
    cpus = env.get(f"AF_CPU_BIND_{rank}", "")
    if mode == "off" or not cpus:
        return "not bound"
    numactl = shutil.which("numactl")
    if mode == "numactl" and numactl and env.get("AF_BOUND") != "1":
        env["AF_BOUND"] = "1"
        args = env.get(f"AF_NUMACTL_{rank}", f"--physcpubind={cpus}").split()
        os.execve(numactl, [numactl, *args, sys.executable, *(sys.argv if argv is None else argv)], dict(env))
    if mode == "numactl" and env.get("AF_BOUND") == "1":
        return f"numactl {env.get(f'AF_NUMACTL_{rank}', '')}"
    try:
        os.sched_setaffinity(0, _cpus(cpus))
    except (OSError, ValueError) as e:
        print(f"warning: could not bind local rank {rank} to CPUs {cpus}: {e}", file=sys.stderr)
        return "not bound"
    return f"CPU affinity {cpus}"
