"""The job's resolved layout: how the world splits and what follows from it, decided once.

Like torchtitan's ``ParallelDims``: :func:`decide` (called only by ``Recipe.resolved``) turns the
recipe's ``parallel`` request and the world into one frozen :class:`Layout`; the launcher writes it
into plan.json (``recipe.layout``) and every reader (memory estimate, launcher, workers, optimizer,
checkpoint) takes it from there, never re-deciding. Pure Python (no MindSpore).
"""
from __future__ import annotations

from dataclasses import dataclass

from jobspec.platform import PLATFORMS, Device, Platform
from jobspec.recipe_parse import Problem


@dataclass(frozen=True)
class Layout:
    """world = tp x dp x pp; the defaults are one CPU process."""

    tp: int = 1
    dp: int = 1
    pp: int = 1
    shard_optimizer: bool = False  # the AdamW state split over DP (ZeRO-1); only with dp > 1
    shard_gradients: bool = False  # and each micro-batch's gradients reduce-scattered into fp32 shards (ZeRO-2)
    shard_weights: bool = False  # and each decoder layer's weights held as shards, gathered per use (ZeRO-3)
    overlap_grad_reduce: bool = False  # DP reduction started by the backward; only with dp > 1
    vocab_parallel: bool = False  # embedding and LM head split by vocabulary rows; only with tp > 1
    host_collectives: bool = False  # DP sums through shared memory (finetune/hostcomm.py); CPU, one node
    micro_batch_size: int = 1
    grad_accum: int = 1
    seq_len: int = 1024
    device: Device = "cpu"

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over the whole job (micro batch x grad accum x dp)."""
        return self.micro_batch_size * self.grad_accum * self.dp

    @property
    def zero(self) -> int:
        """The ZeRO stage over DP: 0 (nothing sharded), 1 (optimizer state), 2 (and gradients), 3 (and weights)."""
        return 3 if self.shard_weights else 2 if self.shard_gradients else int(self.shard_optimizer)

    def sharding(self, method: str = "full") -> str:
        """What DP shards, for the plan (``method``: train.method)."""
        if not self.shard_optimizer:
            return "optimizer state replicated"
        lora = " (LoRA: the adapters and the frozen base)" if method == "lora" else ""
        what = {1: "", 2: " and gradients", 3: ", gradients and decoder-layer weights" + lora}[self.zero]
        return f"optimizer state{what} sharded over DP (ZeRO-{self.zero})"

    @property
    def platform(self) -> Platform:
        """What the device decides (``jobspec/platform.py``)."""
        return PLATFORMS[self.device]

    @property
    def device_target(self) -> str:
        """MindSpore's name of the device."""
        return self.platform.target

    def world_problem(self, world: int, device: str) -> str | None:
        """Why this layout is not the one for ``world`` workers on ``device`` (a plan made for another job)."""
        if world == self.world and device == self.device:
            return None
        return (f"the plan was made for {self.world} worker(s) on {self.device} (TP {self.tp} x DP {self.dp} x PP "
                f"{self.pp}), this job has {world} on {device}; make the plan again for this job "
                "(python -m launcher plan)")


def world_problems(tp: int, dp: int, pp: int, world: int) -> list[Problem]:
    """Why the ``parallel`` request cannot run on ``world`` workers (nodes x workers per node), each with the fix."""
    if world % (tp * pp):
        fit = max(d for d in range(1, world + 1) if world % d == 0 and d <= tp)
        return [Problem("parallel.tp", f"TP x PP = {tp * pp} does not divide the {world} worker(s) of this job "
                        "(nodes x workers per node)", str(fit), repr(tp))]
    if dp and tp * dp * pp != world:
        return [Problem("parallel.dp", f"TP={tp} x DP={dp} x PP={pp} = {tp * dp * pp} != world {world} "
                        "(nodes x workers per node); DP=0 derives it", str(world // (tp * pp)), repr(dp))]
    return []


def host_collectives_refusal(device: Device, dp: int, nnodes: int) -> str | None:
    """Why DP cannot sum through shared memory (``parallel.host_collectives``), or None."""
    if PLATFORMS[device].native_collectives:
        return f"launch.device={device}: HCCL moves DP traffic between the NPUs"
    if nnodes > 1:
        return f"launch.nnodes={nnodes}: a DP group spans nodes"
    return "one DP rank: nothing to sum" if dp < 2 else None


@dataclass(frozen=True)
class LayoutRequest:
    """What :func:`decide` takes: the recipe's ``parallel`` request (``zero``, ``shard_optimizer`` and
    ``host_collectives`` may be left to it), the batch and sequence, and the job's world."""

    world: int
    device: Device
    tp: int = 1
    dp: int = 0  # 0: world / (tp x pp)
    pp: int = 1
    zero: int | str = "auto"
    shard_optimizer: bool | None = None
    overlap_grad_reduce: bool = True
    vocab_parallel: bool = True
    host_collectives: bool | None = None
    nnodes: int = 1
    micro_batch_size: int = 1
    grad_accum: int = 1
    seq_len: int = 1024


def decide(r: LayoutRequest) -> Layout:
    """The layout of a ``parallel`` request on ``r.world`` workers: dp 0 -> world / (tp x pp), an unset
    shard_optimizer -> on when dp > 1 (ZeRO-1; ``zero`` 1-3 sets it, 2 and 3 shard the gradients, 3 the weights),
    overlap only with dp > 1 (and always with ZeRO-3, whose layers reduce during their recomputed backward:
    parallel/zero3.py Zero3Reduction), vocab-parallel only with tp > 1, host collectives (unless refused) wherever
    :func:`host_collectives_refusal` finds no reason against them. The request is checked against the world
    first (:func:`world_problems`) and ``zero`` against shard_optimizer (:func:`zero_problems`)."""
    dp = r.dp or r.world // (r.tp * r.pp)
    shard = r.shard_optimizer if r.shard_optimizer is not None else dp > 1
    shard = shard or r.zero in (1, 2, 3)
    host = r.host_collectives is not False and host_collectives_refusal(r.device, dp, r.nnodes) is None
    return Layout(tp=r.tp, dp=dp, pp=r.pp, shard_optimizer=shard and dp > 1, host_collectives=host,
                  shard_gradients=r.zero in (2, 3) and dp > 1, shard_weights=r.zero == 3 and dp > 1,
                  overlap_grad_reduce=(r.overlap_grad_reduce or r.zero == 3) and dp > 1,
                  vocab_parallel=r.vocab_parallel and r.tp > 1,
                  micro_batch_size=r.micro_batch_size, grad_accum=r.grad_accum, seq_len=r.seq_len, device=r.device)


def host_collectives_problems(asked: bool | None, layout: Layout, nnodes: int) -> list[Problem]:
    """parallel.host_collectives=true where :func:`host_collectives_refusal` refuses it."""
    why = host_collectives_refusal(layout.device, layout.dp, nnodes)
    return [Problem("parallel.host_collectives", f"not with {why}", "false", "true")] if asked and why else []


def host_collectives_choice(asked: bool | None, layout: Layout, nnodes: int) -> str:
    """The plan's line for the decided ``layout`` (``asked``: the recipe's parallel.host_collectives)."""
    auto = " (auto)" if asked is None else ""
    if layout.host_collectives:
        return "on: DP sums through shared memory (/dev/shm), not MindSpore's CPU collectives" + auto
    if asked is False:
        return "off (parallel.host_collectives=false)"
    return f"off{auto}: {host_collectives_refusal(layout.device, layout.dp, nnodes)}"


ZERO_STAGES = ("auto", 1, 2, 3)


def zero_problems(zero: int | str, shard_optimizer: bool | None) -> list[Problem]:
    """``parallel.zero`` outside ``ZERO_STAGES``, or a stage that contradicts ``parallel.shard_optimizer=false``."""
    if zero not in ZERO_STAGES:
        return [Problem("parallel.zero", "the stages are auto, 1, 2 and 3", "2", repr(zero))]
    if zero != "auto" and shard_optimizer is False:
        return [Problem("parallel.zero", f"stage {zero} shards the optimizer state, which parallel.shard_optimizer="
                        "false turns off; leave parallel.shard_optimizer unset", "auto", repr(zero))]
    return []
