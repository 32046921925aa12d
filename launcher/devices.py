"""NPU discovery: /dev/davinciN, management devices, driver mounts, visibility variables, npu-smi.

Every probe takes its root paths, environment and an ``npu-smi`` runner as parameters, so tests
use a fake /dev tree and recorded ``npu-smi`` outputs.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from jobspec.cpus import parse_cpulist
from jobspec.platform import platform_of
from launcher.mounts import DRIVER_MOUNTS, MGMT_DEVICES
from launcher.npu_smi import NpuProcess, NpuSmi, dcmi_error, parse_info, parse_processes, run_npu_smi


def parse_visible_devices(text: str) -> list[int]:
    """ASCEND_VISIBLE_DEVICES: ids and ranges (``0-3,6``) or the operator's annotation form
    (``Ascend910-0,Ascend910-1``, from the ``huawei.com/Ascend910`` pod annotation)."""
    named = [re.fullmatch(r"[A-Za-z][A-Za-z0-9]*-(\d+)", p.strip()) for p in text.split(",")]
    if all(named):
        return sorted({int(m.group(1)) for m in named if m})
    try:
        return parse_cpulist(text, "ASCEND_VISIBLE_DEVICES")
    except ValueError:
        raise ValueError(f"ASCEND_VISIBLE_DEVICES={text!r}: expected ids or ranges (0-3 or 0,1,4) or the "
                         "device names Ascend910-0,Ascend910-1 (e.g. ASCEND_VISIBLE_DEVICES=0-7)") from None


def format_id_list(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (the cpulist / device-range form)."""
    out, ids = [], sorted(set(ids))
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def parse_info_m(text: str) -> dict[int, int]:
    """``npu-smi info -m`` -> {chip logic id: npu id} (Mcu rows, logic id '-', are skipped)."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"\s*(\d+)\s+(\d+)\s+(\d+)\s+\S", line)
        if m:
            out[int(m.group(3))] = int(m.group(1))
    return out


def parse_topo(text: str) -> dict[int, list[int]]:
    """``npu-smi info -t topo`` -> {npu id: CPUs of its CPU Affinity column}."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"NPU(\d+)\s.*?\s([\d,-]+)\s*$", line)
        if m and "CPU Affinity" not in line:
            out[int(m.group(1))] = parse_cpulist(m.group(2), "CPU Affinity")
    return out


@dataclass
class Devices:
    """What this node offers the workers."""

    present: list[int] = field(default_factory=list)  # physical ids from /dev/davinciN
    visible: list[int] = field(default_factory=list)  # physical ids the workers use, in local-rank order
    missing_mgmt: list[str] = field(default_factory=list)
    missing_mounts: list[str] = field(default_factory=list)
    hbm_total_mb: dict[int, int] = field(default_factory=dict)  # physical id -> HBM size
    cpu_affinity: dict[int, list[int]] = field(default_factory=dict)  # physical id -> CPUs (npu-smi topo)
    logical: dict[int, int] = field(default_factory=dict)  # physical id -> logical id (npu-smi info -m)
    bus_id: dict[int, str] = field(default_factory=dict)  # physical id -> PCI address (npu-smi info)
    processes: list[NpuProcess] = field(default_factory=list)  # npu-smi info process table
    dcmi_error: int | None = None  # npu-smi's "ret is -8020" (launcher/mounts.py DCMI_ERRORS)
    worker_env: dict[str, str] = field(default_factory=dict)  # visibility variables to give workers
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def has_npu(self) -> bool:
        return bool(self.present)

    @property
    def busy(self) -> list[NpuProcess]:
        """Processes already holding an NPU the workers are to use (npu-smi reads no process of ours yet)."""
        return [p for p in self.processes if p.npu in self.visible]

    def busy_rows(self) -> list[tuple[str, str]]:
        """(detail, fix) per busy NPU: the holders by pid, name and MB, and how to free or avoid it."""
        out = []
        for npu in sorted({p.npu for p in self.busy}):
            procs = [p for p in self.busy if p.npu == npu]
            who = ", ".join(f"pid {p.pid} {p.name} ({p.memory_mb} MB)" for p in procs)
            pids = " ".join(str(p.pid_in_container or p.pid) for p in procs)
            where = ("" if all(p.pid_in_container for p in procs) else
                     " (npu-smi shows host pids: run it on the host or in the holder's container)")
            free = [i for i in self.present if i not in {p.npu for p in self.processes}]
            out.append((f"NPU {npu} is already in use by {who}",
                        f"stop it if it is stale (kill {pids}){where}, or use free NPUs only: "
                        f"ASCEND_VISIBLE_DEVICES={format_id_list(free) or '<free ids>'} "
                        "(a stale holder makes HCCL initialisation fail or hang)"))
        return out

    def summary(self, launch_device: str = "auto", recipe: str = "") -> str:
        """What was found and, without NPUs, what the recipe will really do (``launch.device``)."""
        if not self.has_npu and platform_of(launch_device, self.has_npu).accelerator:
            return (f"no NPU (/dev/davinciN) found, but recipe {recipe} runs on NPUs (launch.device=npu): preflight "
                    "stops here; add the --device=/dev/davinciN flags, or RECIPE=tiny-cpu for CPU workers")
        if not self.has_npu:
            return f"no NPU (/dev/davinciN) found: workers run on CPU (recipe {recipe or 'tiny-cpu'})"
        return (f"{len(self.present)} NPUs present (/dev/davinci{format_id_list(self.present)}), "
                f"{len(self.visible)} visible to workers: physical {format_id_list(self.visible) or 'none'}")


def probe(dev_dir: Path = Path("/dev"), root: Path = Path("/"), env: Mapping[str, str] | None = None,
          npu_smi: NpuSmi | None = run_npu_smi) -> Devices:
    """Find NPUs, apply ASCEND_VISIBLE_DEVICES (physical) then ASCEND_RT_VISIBLE_DEVICES (logical)."""
    env = {} if env is None else env
    d = Devices()
    if dev_dir.is_dir():
        d.present = sorted(int(m.group(1)) for p in dev_dir.iterdir()
                           if (m := re.fullmatch(r"davinci(\d+)", p.name)))
    if not d.present:
        return d
    d.missing_mgmt = [m for m in MGMT_DEVICES if not (dev_dir / m).exists()]
    d.missing_mounts = [m for m in DRIVER_MOUNTS if not (root / m.lstrip("/")).exists()]
    d.visible = list(d.present)
    phys = env.get("ASCEND_VISIBLE_DEVICES", "").strip()
    if phys:
        try:
            wanted = parse_visible_devices(phys)
            absent = [i for i in wanted if i not in d.present]
            if absent:
                d.problems.append(f"ASCEND_VISIBLE_DEVICES={phys}: /dev/davinci{format_id_list(absent)} not present; "
                                  f"use ids from {format_id_list(d.present)} or add --device=/dev/davinciN")
            d.visible = [i for i in wanted if i in d.present]
            d.notes.append(f"ASCEND_VISIBLE_DEVICES={phys} selects physical NPUs {format_id_list(d.visible)}")
        except ValueError as e:
            d.problems.append(str(e))
    if npu_smi is not None:
        _add_npu_smi(d, npu_smi)
    # The runtime numbers the devices it sees 0..n-1 (npu-smi info -m: Chip Logic ID per NPU ID).
    logical_of = {p: d.logical.get(p, i) for i, p in enumerate(d.present)}
    rt = env.get("ASCEND_RT_VISIBLE_DEVICES", "").strip()
    if rt:
        try:
            ids = parse_cpulist(rt, "ASCEND_RT_VISIBLE_DEVICES")
            bad = [i for i in ids if i >= len(d.present)]
            if bad:
                d.problems.append(f"ASCEND_RT_VISIBLE_DEVICES={rt}: logical ids {bad} >= the {len(d.present)} "
                                  f"devices this container sees; use logical ids 0-{len(d.present) - 1}")
            d.visible = [d.present[i] for i in ids if i < len(d.present) and d.present[i] in d.visible]
            d.notes.append(f"ASCEND_RT_VISIBLE_DEVICES={rt} (logical ids) selects physical NPUs "
                           f"{format_id_list(d.visible)}")
        except ValueError as e:
            d.problems.append(str(e))
    if d.visible != d.present:  # workers number their devices 0..n-1; make the runtime agree
        d.worker_env["ASCEND_RT_VISIBLE_DEVICES"] = ",".join(str(logical_of[p]) for p in d.visible)
    return d


def _add_npu_smi(d: Devices, npu_smi: NpuSmi) -> None:
    info = npu_smi(["info"])
    d.dcmi_error = dcmi_error(info) if info else None
    if d.dcmi_error is not None:  # preflight's mounts row says what it means
        return
    if info is None:
        d.notes.append("npu-smi not available: HBM size and CPU affinity unknown (mount /usr/local/bin/npu-smi)")
        return
    for npu, row in parse_info(info).items():
        d.bus_id[npu] = row.bus_id.lower()
        if row.hbm_total_mb:
            d.hbm_total_mb[npu] = row.hbm_total_mb
        if row.health not in ("OK", "Warning"):
            d.problems.append(f"NPU {npu}: npu-smi health {row.health}; check `npu-smi info -t health -i {npu}`")
    d.processes = parse_processes(info)
    chips = npu_smi(["info", "-m"])
    if chips:
        d.logical = {npu: logic for logic, npu in parse_info_m(chips).items()}
    topo = npu_smi(["info", "-t", "topo"])
    if topo:
        d.cpu_affinity = parse_topo(topo)
