"""The platform a job runs on, as one record of what the device decides.

The recipe names the device (``launch.device``: 'npu', 'cpu' or 'auto'); :func:`platform_of` makes 'auto'
concrete (the launcher from its probe, launcher/devices.py; a worker or tool without a plan from
:func:`npu_present`) and :data:`PLATFORMS` gives the name's :class:`Platform`, which is passed on
(``RankInfo.platform``). MindSpore's name of the device ('Ascend' | 'CPU') is ``Platform.target``; it
is only handed to MindSpore. Code reads the record's fields, never the names: this is the one module
that compares device names (tests/test_import_rules.py holds that). Pure Python, no MindSpore.
"""
from __future__ import annotations

import glob
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Device = Literal["npu", "cpu"]


@dataclass(frozen=True)
class Platform:
    """What running on one kind of device means for the code, one fact a field."""

    device: Device  # the recipe's name (launch.device, plan.json)
    target: str  # MindSpore's name (mindspore.set_device)
    accelerator: bool  # each worker owns one device (DEVICE_ID) with its own memory; else host processes
    fused_kernels: bool  # the fused kernels of finetune/model/kernels.py (and their RNG); else the reference math
    kernels_block: bool  # kernels run when called (mindspore.runtime.launch_blocking), not queued asynchronously
    native_collectives: bool  # the backend has every DP collective (HCCL); else emulated, shared memory possible
    default_precision: Literal["bf16", "fp32"]  # what train.precision auto means here
    bf16_matmul: bool  # the device multiplies in bf16
    chip_peak: bool  # MFU's peak: the chip's bf16 figure (perf.PEAK_TFLOPS); else this host's measured fp32 rate
    host_memory: bool  # tensors live in host memory: numpy works on them in place, the peak is the RSS


PLATFORMS: dict[str, Platform] = {
    "npu": Platform("npu", "Ascend", accelerator=True, fused_kernels=True, kernels_block=False,
                    native_collectives=True, default_precision="bf16", bf16_matmul=True, chip_peak=True,
                    host_memory=False),
    "cpu": Platform("cpu", "CPU", accelerator=False, fused_kernels=False, kernels_block=True,
                    native_collectives=False, default_precision="fp32", bf16_matmul=False, chip_peak=False,
                    host_memory=True),
}
_BY_TARGET = {p.target: p for p in PLATFORMS.values()}


def by_target(target: str) -> Platform:
    """The platform of MindSpore's device name ('Ascend' | 'CPU')."""
    return _BY_TARGET[target]


def npu_present() -> bool:
    """Whether this machine shows an NPU (/dev/davinciN): the worker side's one probe."""
    return bool(glob.glob("/dev/davinci[0-9]*"))


def visible_npus(dev: Path = Path("/dev"), env: Mapping[str, str] = os.environ) -> int:
    """How many NPUs this process may use: the count of ``ASCEND_RT_VISIBLE_DEVICES`` when set (the launcher
    sets it for a subset), else of ``/dev/davinciN``; the runtime numbers them 0..n-1 whatever the physical N."""
    visible = env.get("ASCEND_RT_VISIBLE_DEVICES", "").strip()
    if visible:
        return len([v for v in visible.split(",") if v.strip()])
    return len([p for p in dev.glob("davinci[0-9]*") if p.name.removeprefix("davinci").isdigit()])


def platform_of(setting: str, has_npu: bool | None = None) -> Platform:
    """The platform of ``launch.device``: 'npu' and 'cpu' as named, 'auto' the NPU when there is one
    (``has_npu``: the caller's probe; None: :func:`npu_present`)."""
    if setting in PLATFORMS:
        return PLATFORMS[setting]
    return PLATFORMS["npu" if (npu_present() if has_npu is None else has_npu) else "cpu"]


def in_host_memory(tensor: Any) -> bool:
    """Whether a MindSpore tensor's memory is host memory (its ``device`` is MindSpore's CPU name)."""
    return bool(tensor.device == PLATFORMS["cpu"].target)
