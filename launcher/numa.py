"""NUMA / CPU binding per local rank: the NPU's NUMA node, that node's CPUs, the container's cpuset.

msrun 2.10 can bind (``--bind_core`` / ``--bind_numa`` with True or a dict keyed by device), but it
resolves devices itself through npu-smi and builds the numactl/taskset prefix internally, so it
cannot take our per-rank plan as an arbitrary prefix. Each worker therefore applies its binding at
start from environment variables (see :func:`worker_env` and ``finetune/affinity.py``).
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from jobspec.cpus import allowed_cpus, read_cpulist
from launcher.devices import Devices, format_id_list


def numa_nodes(sys_root: Path = Path("/sys")) -> dict[int, list[int]]:
    """{node id: CPUs} from /sys/devices/system/node/node*/cpulist."""
    base = sys_root / "devices/system/node"
    out = {}
    for d in base.glob("node[0-9]*"):
        if d.name[4:].isdigit():
            out[int(d.name[4:])] = read_cpulist(d / "cpulist")
    return dict(sorted(out.items()))


def pci_numa(sys_root: Path, devices: Devices) -> dict[int, int]:
    """{physical NPU id: numa_node} of the PCI devices npu-smi names (-1 means unknown).

    Without npu-smi there is no mapping: PCI bus order is not NPU order on the Atlas 800T A2
    (NPU 0..7 on buses C1, 01, C2, 02, 81, 41, 82, 42 in one recording, C1, C2, 81, 82, 41, 42, 01, 02
    in another), so guessing from it would bind ranks to the wrong node.
    """
    pci = sys_root / "bus/pci/devices"
    out = {}
    for npu, addr in devices.bus_id.items():
        node = _read(pci / addr / "numa_node")
        if node.lstrip("-").isdigit() and int(node) >= 0:
            out[npu] = int(node)
    return out


def _read(p: Path) -> str:
    try:
        return p.read_text().strip()
    except OSError:
        return ""


@dataclass
class RankBinding:
    """How one local rank is pinned; ``cpus`` empty means not bound."""

    local_rank: int
    device: int | None
    numa_node: int | None
    cpus: list[int] = field(default_factory=list)
    method: str = "off"  # numactl | affinity | off
    reason: str = ""

    def numactl_args(self, nodes: dict[int, list[int]]) -> list[str]:
        """numactl options: whole node -> --cpunodebind, part of one -> --physcpubind; memory on the node."""
        if self.numa_node is None:
            return [f"--physcpubind={format_id_list(self.cpus)}"]
        cpu = (f"--cpunodebind={self.numa_node}" if sorted(nodes.get(self.numa_node, [])) == sorted(self.cpus)
               else f"--physcpubind={format_id_list(self.cpus)}")
        return [cpu, f"--membind={self.numa_node}"]

    def describe(self, nodes: dict[int, list[int]]) -> str:
        if self.method == "off" or not self.cpus:
            return f"rank {self.local_rank}: not bound ({self.reason})"
        how = ("numactl " + " ".join(self.numactl_args(nodes)) if self.method == "numactl"
               else f"CPU affinity {format_id_list(self.cpus)}")
        dev = f"NPU {self.device}" if self.device is not None else "CPU worker"
        return f"rank {self.local_rank} ({dev}, NUMA node {self.numa_node}): {how} ({self.reason})"


def _node_of(cpus: list[int], nodes: dict[int, list[int]]) -> int | None:
    best = max(nodes, key=lambda n: len(set(nodes[n]) & set(cpus)), default=None)
    return best if best is not None and set(nodes[best]) & set(cpus) else None


def _split(cpus: list[int], parts: int) -> list[list[int]]:
    """Even contiguous chunks (the first ones one larger when it does not divide)."""
    q, r = divmod(len(cpus), parts)
    out, i = [], 0
    for k in range(parts):
        n = q + (1 if k < r else 0)
        out.append(cpus[i:i + n])
        i += n
    return out


def plan(nproc: int, mode: str, devices: Devices, sys_root: Path = Path("/sys"),
         getaffinity: Callable[[int], set[int]] = os.sched_getaffinity,
         have_numactl: bool | None = None) -> tuple[list[RankBinding], dict]:
    """One binding per local rank, plus a summary dict for plan.json."""
    nodes = numa_nodes(sys_root)
    allowed, allowed_src = allowed_cpus(sys_root, getaffinity)
    have_numactl = bool(shutil.which("numactl")) if have_numactl is None else have_numactl
    method = {"auto": "numactl" if have_numactl else "affinity", "numactl": "numactl" if have_numactl else "affinity",
              "affinity": "affinity", "off": "off"}[mode]
    info = {"mode": mode, "method": method, "allowed_cpus": format_id_list(allowed), "allowed_from": allowed_src,
            "numa_nodes": {str(n): format_id_list(c) for n, c in nodes.items()}}
    if mode == "numactl" and not have_numactl:
        info["note"] = "NUMA_BIND=numactl but numactl is not installed: CPU affinity instead (apt-get install numactl)"
    if method == "off":
        return [RankBinding(i, None, None, reason="NUMA_BIND=off") for i in range(nproc)], info
    ranks: list[RankBinding] = []
    if devices.has_npu and devices.visible:
        sysfs = pci_numa(sys_root, devices)
        for i in range(nproc):
            dev = devices.visible[i] if i < len(devices.visible) else None
            node, why = None, ("NPU NUMA node unknown: even split of allowed CPUs" if devices.bus_id else
                               "no npu-smi, and PCI bus order is not NPU order: even split of allowed CPUs "
                               "(mount /usr/local/bin/npu-smi to bind by NUMA node)")
            if dev in devices.cpu_affinity and nodes:
                node, why = _node_of(devices.cpu_affinity[dev], nodes), "npu-smi topo CPU Affinity"
            elif dev in sysfs:
                node, why = sysfs[dev], "PCI numa_node in sysfs"
            ranks.append(RankBinding(i, dev, node, method=method, reason=why))
        for node in {r.numa_node for r in ranks if r.numa_node is not None}:
            group = [r for r in ranks if r.numa_node == node]
            cpus = [c for c in nodes.get(node, []) if c in set(allowed)]
            if not cpus:
                for r in group:
                    r.numa_node, r.reason = None, f"NUMA node {node} has no allowed CPU: even split"
                continue
            for r, chunk in zip(group, _split(cpus, len(group))):
                r.cpus = chunk
        loose = [r for r in ranks if not r.cpus]
        for r, chunk in zip(loose, _split(allowed, len(loose)) if loose else []):
            r.cpus, r.numa_node = chunk, _node_of(chunk, nodes)
    else:
        for i, chunk in enumerate(_split(allowed, nproc)):
            ranks.append(RankBinding(i, None, _node_of(chunk, nodes), chunk, method, "CPU-only host: even split"))
    for r in ranks:
        if not r.cpus:
            r.method, r.reason = "off", f"fewer allowed CPUs ({len(allowed)}) than ranks"
    return ranks, info


def worker_env(ranks: list[RankBinding], nodes: dict[int, list[int]]) -> dict[str, str]:
    """The contract read by finetune/affinity.py in each worker (local rank = msrun's DEVICE_ID).

    AF_BIND_MODE=numactl|affinity|off; AF_CPU_BIND_<local_rank>=cpulist; AF_MEM_BIND_<local_rank>=node;
    AF_NUMACTL_<local_rank>=space-separated numactl options (numactl mode).
    """
    modes = {r.method for r in ranks if r.cpus}
    env = {"AF_BIND_MODE": modes.pop() if len(modes) == 1 else "off"}
    for r in ranks:
        if r.cpus:
            env[f"AF_CPU_BIND_{r.local_rank}"] = format_id_list(r.cpus)
            if r.numa_node is not None:
                env[f"AF_MEM_BIND_{r.local_rank}"] = str(r.numa_node)
            if r.method == "numactl":
                env[f"AF_NUMACTL_{r.local_rank}"] = " ".join(r.numactl_args(nodes))
    return env


def to_json(ranks: list[RankBinding], nodes: dict[int, list[int]]) -> list[dict]:
    return [{**asdict(r), "cpus": format_id_list(r.cpus), "applied": r.describe(nodes)} for r in ranks]
