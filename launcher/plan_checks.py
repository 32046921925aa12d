"""Refusals when the plan is resolved, before anything is written: several nodes without node 0's address, an
output directory this user cannot write, more workers than this node has NPUs (or CPUs)."""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from jobspec.config import Problem, Recipe
from jobspec.cpus import allowed_cpus
from jobspec.platform import PLATFORMS
from launcher.cluster import Cluster
from launcher.devices import Devices


def problems(recipe: Recipe, overrides: Mapping[str, str], cluster: Cluster, nproc: int, device: str,
             devices: Devices, sys_root: Path) -> list[Problem]:
    """Every plan-time refusal of ``recipe`` (``overrides``: the user's settings) for this node."""
    return (needs_master(recipe, overrides, cluster) + output_problems(Path(recipe.output_dir))
            + nproc_problems(nproc, device, devices, sys_root))


def needs_master(recipe: Recipe, overrides: Mapping[str, str], cluster: Cluster) -> list[Problem]:
    """Several nodes need node 0's address on every node: refused now, not after msrun's cluster timeout."""
    if recipe.launch.nnodes > 1 and "launch.master_addr" not in {**overrides, **cluster.overrides()}:
        return [Problem("", f"launch.nnodes={recipe.launch.nnodes} but no MASTER_ADDR: every node needs node 0's "
                            "address (e.g. MASTER_ADDR=10.0.0.1, the same on every node), or a HOSTFILE")]
    return []


def output_problems(out: Path) -> list[Problem]:
    """OUTPUT_DIR must be a directory this user can create or write (checked before anything is written)."""
    fix = dict(key="output_dir", example="/data/output/run1", value=repr(str(out)))
    near = next((p for p in (out, *out.parents) if p.exists()), Path("/"))
    if not near.is_dir():
        what = "is a file" if near == out else f"is inside {near}, which is a file"
        return [Problem(message=f"{what}, not a directory", **fix)]
    if not os.access(near, os.W_OK | os.X_OK):
        return [Problem(message=f"{near} is not writable by this user (uid {os.getuid()}); use a writable "
                                "directory or mount a volume there", **fix)]
    return []


def nproc_problems(nproc: int, device: str, devices: Devices, sys_root: Path) -> list[Problem]:
    """Refuse more workers than NPUs (or CPUs) present: each is a process with its own copy of the model.

    An NPU plan with no NPU visible is left to preflight's devices row."""
    if PLATFORMS[device].accelerator:
        have, what = len(devices.visible), f"{len(devices.visible)} visible NPU(s)"
        if not devices.has_npu or nproc <= have:
            return []
    else:
        cpus, source = allowed_cpus(sys_root)
        have, what = len(cpus), f"{len(cpus)} CPU(s) this container may use ({source})"
        if nproc <= have:
            return []
    one = "NPU" if PLATFORMS[device].accelerator else "CPU at most"
    return [Problem("launch.nproc_per_node", f"{nproc} workers per node (NPROC_PER_NODE or a hostfile's slots), but "
                    f"this node has {what}: one worker per {one}; leave it unset for the default, or give at most "
                    f"{have}", str(have), str(nproc))]
