"""Workers per node against what this node has: one per visible NPU, on CPU at most one per allowed CPU."""
from __future__ import annotations

from pathlib import Path

from jobspec.config import Problem
from jobspec.cpus import allowed_cpus
from launcher.devices import Devices


def nproc_problems(nproc: int, device: str, devices: Devices, sys_root: Path) -> list[Problem]:
    """Refuse more workers than NPUs (or CPUs) present: each is a process with its own copy of the model.

    An NPU plan with no NPU visible is left to preflight's devices row."""
    if device == "npu":
        have, what = len(devices.visible), f"{len(devices.visible)} visible NPU(s)"
        if not devices.has_npu or nproc <= have:
            return []
    else:
        cpus, source = allowed_cpus(sys_root)
        have, what = len(cpus), f"{len(cpus)} CPU(s) this container may use ({source})"
        if nproc <= have:
            return []
    one = "NPU" if device == "npu" else "CPU at most"
    return [Problem("launch.nproc_per_node", f"{nproc} workers per node (NPROC_PER_NODE or a hostfile's slots), but "
                    f"this node has {what}: one worker per {one}; leave it unset for the default, or give at most "
                    f"{have}", str(have), str(nproc))]
