"""CPUs this container may use: the cgroup cpuset, the CPU quota, the affinity mask (pure Python).

The launcher's NUMA binding (``launcher/numa.py``) and prepare-data's worker count read them here.
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from pathlib import Path


def parse_cpulist(text: str, where: str) -> list[int]:
    """``0-3,8`` -> [0, 1, 2, 3, 8] (CPU lists, and the launcher's NPU id lists); ValueError naming
    ``where`` (a file or variable) and an example for anything else."""
    ids: list[int] = []
    for part in text.replace(" ", "").split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m or (m.group(2) and int(m.group(2)) < int(m.group(1))):
            raise ValueError(f"{where}={text!r}: expected ids or ranges like 0-3 or 0,1,4 (e.g. {where}=0-7)")
        ids += range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1)
    return sorted(set(ids))


def read_cpulist(path: Path) -> list[int]:
    """A sysfs/cgroup cpulist file ('0-3,8') -> CPU ids; [] when absent or empty."""
    try:
        text = path.read_text().strip()
    except OSError:
        return []
    return parse_cpulist(text, str(path)) if text else []


def _affinity(pid: int) -> set[int]:
    return os.sched_getaffinity(pid) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def allowed_cpus(sys_root: Path = Path("/sys"),
                 getaffinity: Callable[[int], set[int]] = _affinity) -> tuple[list[int], str]:
    """(CPUs, where from): cgroup v2 cpuset.cpus.effective, v1 cpuset.cpus, else the affinity mask."""
    for rel in ("fs/cgroup/cpuset.cpus.effective", "fs/cgroup/cpuset/cpuset.cpus"):
        cpus = read_cpulist(sys_root / rel)
        if cpus:
            return cpus, f"/sys/{rel}"
    return sorted(getaffinity(0)), "sched_getaffinity"


def cpu_quota(cgroup: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPU quota / period of cgroup v2 (cpu.max) or v1 (cpu/cpu.cfs_quota_us); None when unlimited."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()  # "<quota|max> <period>"
    except (OSError, ValueError):
        try:
            quota = (cgroup / "cpu" / "cpu.cfs_quota_us").read_text().strip()  # -1: unlimited
            period = (cgroup / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    try:
        q, p = int(quota), int(period)
    except ValueError:  # "max"
        return None
    return q / p if q > 0 and p > 0 else None


def available_cpus(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """How many CPUs this process can keep busy: its affinity mask, capped by the cgroup CPU quota
    (a Kubernetes CPU limit leaves the whole host's CPUs in the mask)."""
    n = len(_affinity(0))
    quota = cpu_quota(cgroup)
    return max(1, min(n, math.ceil(quota)) if quota else n)
