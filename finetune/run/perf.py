"""What a logged step reports about speed: MFU, where the step's time went, device memory; the profiler.

MFU convention (docs/speed.md): model FLOPs per token = 6 x (weights of every matmul, the LM head
included, also when tied to the embedding) + 12 x layers x hidden x seq (attention scores and their
weighted sum, forward and backward, no causal halving). Recompute is not counted. The peak is per
device: bf16 dense from :data:`PEAK_TFLOPS` on Ascend, the measured fp32 matmul rate on CPU.
"""
from __future__ import annotations

import cProfile
import math
import pstats
import re
import time
from pathlib import Path
from typing import Any

from finetune.dist import RankInfo
from jobspec.model_layout import Dims, param_table
from jobspec.platform import Platform

_CALCULATOR = "Huawei Cloud ModelArts MFU calculator, as issue 18 section 1.8 quotes it"
# bf16/fp16 dense peak TFLOPS per chip, keyed by the name npu-smi and CANN's aclrtGetSocName report, with the
# source of each figure; MindSpeed's FSDP2 path divides by a flat 354 for any 910B instead (docs/speed.md).
PEAK_TFLOPS: dict[str, tuple[float, str]] = {
    "910B1": (378.9, _CALCULATOR),
    "910B2": (353.9, _CALCULATOR),
    "910B3": (294.9, _CALCULATOR),
    "910B4": (270.0, _CALCULATOR),
}


def flops_per_token(config: dict, seq_len: int) -> float:
    """Model FLOPs of one trained token (forward + backward) under the convention above."""
    d = Dims.of(config)
    matmul = sum(math.prod(p.shape) for p in param_table(config)
                 if len(p.shape) == 2 and p.name != "model.embed_tokens.weight")
    if d.tied:  # the LM head multiplies by the embedding matrix
        matmul += d.vocab * d.hidden
    return 6.0 * matmul + 12.0 * d.layers * d.hidden * seq_len


def chip_name(device_name: str) -> str | None:
    """``910B3`` from ``Ascend910B3`` (or any text naming the chip); None when unknown."""
    m = re.search(r"910B[1-4]", device_name)
    return m.group(0) if m else None


def soc_name() -> str:
    """This process's chip as CANN names it (``Ascend910B3``: pyACL's ``aclrtGetSocName``, in the CANN image);
    MindSpore 2.10 marks ``mindspore.hal.get_device_name`` for removal. "" when pyACL is missing."""
    try:
        import acl  # type: ignore[import-not-found]  # CANN's Python API, not on CPU hosts
    except ImportError:
        return ""
    return str(acl.get_soc_name() or "")


def device_peak_flops(rank: RankInfo) -> tuple[float | None, str]:
    """(peak FLOP/s of one device or None, where the figure comes from)."""
    if rank.platform.chip_peak:
        name = soc_name()
        chip = chip_name(name)
        if chip is None:
            return None, f"no peak known for {name!r} (table: {', '.join(PEAK_TFLOPS)}): MFU not reported"
        peak, source = PEAK_TFLOPS[chip]
        return peak * 1e12, f"{chip} bf16 peak {peak} TFLOPS ({source}; perf.PEAK_TFLOPS)"
    rate = cpu_matmul_flops()
    return rate, f"measured fp32 matmul rate of this CPU, {rate / 1e9:.1f} GFLOPS"


def cpu_matmul_flops(n: int = 1024, repeats: int = 8) -> float:
    """The best of ``repeats`` timed ``n x n`` fp32 MindSpore matmuls, in FLOP/s (512 x 512 under-measured
    a fresh worker by half or more, so the tiny model read MFU > 1)."""
    import mindspore as ms
    import numpy as np
    from mindspore import ops

    a = ms.Tensor(np.random.default_rng(0).standard_normal((n, n)).astype(np.float32))
    ops.matmul(a, a).asnumpy()  # warm-up: kernel selection
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        ops.matmul(a, a).asnumpy()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def peak_memory_bytes(platform: Platform) -> int:
    """Peak device memory of this process: the allocator's maximum on Ascend, peak RSS on CPU."""
    if not platform.host_memory:
        import mindspore as ms

        return int(ms.runtime.max_memory_allocated())
    return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """This process's peak resident memory: Linux's high-water mark of its own address space (``VmHWM``).

    Not ``getrusage``'s ``ru_maxrss``: exec records the parent's high-water mark there (the address space a
    fork or vfork shared), so a worker started by a large process (pytest after a thousand tests) reports
    at least its parent's peak."""
    return _status_bytes("VmHWM")


def rss_bytes() -> int:
    """This process's resident memory now (``VmRSS``)."""
    return _status_bytes("VmRSS")


def _status_bytes(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field} line: memory on CPU is measured on Linux only")
    return int(match[1]) * 1024


class StepTimer:
    """Host wall time per phase of the steps since the last report.

    On Ascend PyNative launches kernels asynchronously: a phase's time is until its last launch, and
    the wait for the device shows up where the host first reads a result (the optimizer's norm).
    """

    PHASES = ("data", "fwd_bwd", "optimizer")

    def __init__(self) -> None:
        self.totals = dict.fromkeys(self.PHASES, 0.0)
        self.steps = 0
        self._t = time.perf_counter()

    def start(self) -> None:
        self._t = time.perf_counter()

    def mark(self, phase: str) -> None:
        """The time since the previous mark (or start) belongs to ``phase``."""
        now = time.perf_counter()
        self.totals[phase] += now - self._t
        self._t = now
        self.steps += phase == self.PHASES[-1]

    def report(self, comm_s: float) -> dict[str, float]:
        """Mean seconds per step of each phase (``comm_s``: the optimizer's gradient reduction time);
        resets the window."""
        n = max(self.steps, 1)
        out = {f"time_{k}_s": round(v / n, 6) for k, v in self.totals.items()}
        out["time_comm_s"] = round(comm_s / n, 6)
        self.totals = dict.fromkeys(self.PHASES, 0.0)
        self.steps = 0
        return out


OFFLINE_ANALYSIS = "python -c \"from mindspore.profiler.profiler import analyse; analyse('{dir}')\""


class StepProfiler:
    """``train.profile_steps: [start, end]`` on rank 0: MindSpore's profiler on Ascend, cProfile on CPU.

    Steps are 1-based and inclusive; output goes to ``out`` (the run's ``profile/``). On Ascend the trace is
    only collected (``mindspore.profiler.profile`` starts itself; ``tensorboard_trace_handler`` with
    ``analyse_flag=False``): the analysis runs offline afterwards (:data:`OFFLINE_ANALYSIS`), so rank 0
    never analyses while the other ranks wait in a collective (HCCL_EXEC_TIMEOUT).
    """

    def __init__(self, steps: list[int], rank: RankInfo, out: Path):
        self.first, self.last = (steps[0], steps[1]) if steps and rank.is_main else (0, -1)
        self.rank, self.dir = rank, out
        self._prof: Any = None  # mindspore.profiler.profile (untyped) or cProfile.Profile

    def before(self, step: int) -> None:
        """Called before step ``step`` runs."""
        if step != self.first:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.rank.platform.accelerator:
            from mindspore.profiler import profile, tensorboard_trace_handler

            self._prof = profile(on_trace_ready=tensorboard_trace_handler(dir_name=str(self.dir), analyse_flag=False))
        else:
            self._prof = cProfile.Profile()
            self._prof.enable()

    def after(self, step: int) -> None:
        """Called after step ``step`` ran."""
        if step != self.last or self._prof is None:
            return
        if isinstance(self._prof, cProfile.Profile):
            self._prof.disable()
            self._prof.dump_stats(str(self.dir / "rank0.prof"))
            with (self.dir / "rank0.txt").open("w") as f:
                pstats.Stats(self._prof, stream=f).sort_stats("cumulative").print_stats(40)
            where = f"{self.dir / 'rank0.prof'} (top functions in rank0.txt)"
        else:
            self._prof.stop()  # collection only: the trace handler does not analyse
            where = f"{self.dir}; analyse it offline, after the run: {OFFLINE_ANALYSIS.format(dir=self.dir)}"
        self._prof = None
        self.rank.log(f"[train] profile of steps {self.first}-{self.last} written to {where}")
