"""Choosing the layout from the memory estimate: ``parallel.tp: auto`` and ``parallel.zero: auto`` together,
and what each ZeRO stage moves per step (pure Python; the launcher imports it).

The choice is the lowest ZeRO stage, and at it the smallest TP, whose estimate (``jobspec.memory``) fits: ZeRO-2
and ZeRO-3 only where no TP fits with a lower stage (:func:`choose_layout`). Where the
stage is refused (``jobspec.layout.zero_problems``) is no concern of the choice: the resolved recipe is
checked after it, as any other.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobspec.config import ConfigError, Problem, Recipe, resolved_model_dir
from jobspec.lora_config import trainable_elements
from jobspec.memory import _DTYPE_BYTES, FULL_FT, MemoryEstimate, TrainShape, estimate_memory, layer_elements
from jobspec.model_layout import local_shapes, tp_problems
from jobspec.platform import PLATFORMS

NPU_USABLE_BYTES = 60 * 2**30  # of a 64 GB 910B's HBM, what a job may plan with (the rest: runtime, HCCL)
# What the layout choice plans with: 90% of the usable memory, a margin for the allocator's fragmentation
# and the estimate's error, kept until a 910B's measured peak (metrics.jsonl's step-1 memory record) confirms
# the estimate; an explicit parallel.tp may use all.
PLANNED_BYTES = NPU_USABLE_BYTES * 9 // 10
MARGIN_NOTE = ("10% planning margin kept until device measurements of the estimate exist "
               "(metrics.jsonl step 1: memory_peak_reserved_bytes beside memory_estimate_bytes)")
TP_CANDIDATES = (1, 2, 4, 8)
ZERO_CANDIDATES = (1, 2, 3)


@dataclass
class LayoutChoice:
    """A layout that fits (``tp`` None: none does) and why it was chosen."""

    tp: int | None
    dp: int
    estimate: MemoryEstimate | None
    why: str
    zero: int = 1

    @property
    def label(self) -> str:
        """``TP 8 x DP 4, ZeRO-3`` (docs/sizes.md's table, the plan's lines)."""
        return f"TP {self.tp} x DP {self.dp}" + (f", ZeRO-{self.zero}" if self.dp > 1 else "")


def dp_link(tp: int, dp: int, npus_per_node: int) -> str:
    """The link a DP group's collectives cross: its members are ``tp`` ranks apart (rank = dp_rank x tp +
    tp_rank, ``finetune/dist.py``), a node holds ``npus_per_node`` consecutive ranks."""
    nodes = min(dp, math.ceil(tp * dp / npus_per_node))
    return "HCCS inside a node" if nodes <= 1 else f"RoCE between {nodes} nodes"


def step_traffic(stage: int, *, weights: int, trained: int, dp: int, grad_accum: int, nbytes: int,
                 whole: int = 0) -> int:
    """Bytes one rank sends per optimizer step over its DP group (ring collectives: a reduce-scatter or an
    all-gather of S bytes sends (d-1)/d x S, an all-reduce twice that). ``weights``: this TP rank's weight
    elements, ``trained``: those with gradients, ``nbytes``: the compute dtype's, A = ``grad_accum``, ``whole``:
    the weights ZeRO-3 keeps whole (embedding, final norm, LM head: ``finetune/parallel/zero3.py``).

    - 0: one all-reduce of the fp32 gradient sums: 2 x 4 x trained;
    - 1: one reduce-scatter of them, one all-gather of the updated weights: (4 + b) x trained;
    - 2: a reduce-scatter per micro-batch, one all-gather: (4A + b) x trained;
    - 3: a reduce-scatter per micro-batch, every decoder layer's weights gathered twice per micro-batch
      (forward, recomputed backward), after the step only the whole weights gathered: 4A x trained + 2A x b x
      (weights - whole) + b x whole.
    """
    if dp < 2:
        return 0
    per = {0: 8 * trained, 1: (4 + nbytes) * trained, 2: (4 * grad_accum + nbytes) * trained,
           3: 4 * grad_accum * trained + 2 * grad_accum * nbytes * (weights - whole) + nbytes * whole}[stage]
    return per * (dp - 1) // dp


def traffic_line(cfg: dict[str, Any], tp: int, dp: int, shape: TrainShape, npus_per_node: int) -> str:
    """Per step, the bytes a rank sends over its DP group at each ZeRO stage and over which link."""
    if dp < 2:
        return "no DP traffic (DP 1)"
    vp = shape.vocab_parallel and tp > 1
    local = local_shapes(cfg, tp, vp)
    weights = sum(math.prod(s) for s in local.values())
    adapters, saved = trainable_elements(cfg, shape.lora, tp, vp) if shape.lora else (0, weights)
    nbytes = _DTYPE_BYTES[shape.precision]
    sent = {z: step_traffic(z, weights=weights, trained=adapters + saved, dp=dp, grad_accum=shape.grad_accum,
                            nbytes=nbytes, whole=weights - sum(layer_elements(local))) for z in ZERO_CANDIDATES}
    each = ", ".join(f"ZeRO-{z} {b / 1e9:.1f} GB" for z, b in sent.items())
    return (f"per step a rank sends over {dp_link(tp, dp, npus_per_node)} (DP {dp}, grad_accum "
            f"{shape.grad_accum}): {each}")


def choose_layout(cfg: dict[str, Any], world: int, *, seq_len: int, npus_per_node: int = 8,
                  shape: TrainShape = FULL_FT, usable: int = PLANNED_BYTES, tps: tuple[int, ...] = TP_CANDIDATES,
                  stages: tuple[int, ...] = ZERO_CANDIDATES,
                  estimator: Callable[..., MemoryEstimate] = estimate_memory) -> LayoutChoice:
    """The lowest ZeRO stage of ``stages``, and at it the smallest TP of ``tps`` that divides the heads and KV heads
    (``tp_problems``), stays inside a node and divides ``world``, whose estimate of ``shape`` fits ``usable`` bytes
    per device: each stage up multiplies the DP traffic (:func:`step_traffic`: ZeRO-2 reduce-scatters every
    micro-batch, ZeRO-3 also gathers every layer twice per micro-batch), while TP's stays inside a node on HCCS.
    So ZeRO-3 only where nothing else fits. With DP 1 (or the optimizer not sharded) the stage changes nothing:
    tried once."""
    refused: list[str] = []
    for zero in stages:
        for tp in tps:
            if tp > npus_per_node or world % tp or tp_problems(cfg, tp, vocab_parallel=shape.vocab_parallel and tp > 1):
                continue
            dp = world // tp
            sharded = dp > 1 and shape.shard_optimizer
            if not sharded and zero != stages[0]:  # nothing to shard: tried once, with the first stage
                continue
            est = dataclasses.replace(shape, zero=zero).estimate(cfg, tp, dp, seq_len, estimator)
            name = f"TP {tp}" + (f" ZeRO-{zero}" if sharded else "")
            if est.total <= usable:
                fits = f"fits ({est.total / 2**30:.1f} GiB per NPU)"
                return LayoutChoice(tp, dp, est, f"{name}: " + ("; ".join(refused) or fits), zero)
            refused.append(f"{name} needs {est.total / 2**30:.1f} GiB per NPU > {usable / 2**30:.0f} planned")
    return LayoutChoice(None, 0, None, "; ".join(refused) or f"no TP up to {npus_per_node} divides the heads")


def smallest_world(cfg: dict[str, Any], *, seq_len: int, npus_per_node: int = 8, shape: TrainShape = FULL_FT,
                   usable: int = PLANNED_BYTES, max_world: int = 256,
                   stages: tuple[int, ...] = ZERO_CANDIDATES) -> tuple[int, LayoutChoice]:
    """The fewest devices (1, 2, 4, then whole nodes doubling) with a layout that fits; (0, the last
    refusal) when none up to ``max_world`` (32 nodes) does."""
    worlds = [w for w in (1, 2, 4) if w < npus_per_node] + \
        [npus_per_node * 2**k for k in range(max_world.bit_length()) if npus_per_node * 2**k <= max_world]
    for world in worlds:
        choice = choose_layout(cfg, world, seq_len=seq_len, npus_per_node=npus_per_node, shape=shape, usable=usable,
                               stages=stages)
        if choice.tp is not None:
            return world, choice
    return 0, LayoutChoice(None, 0, None, f"at {worlds[-1]} NPUs: {choice.why}")


def no_fit_advice(cfg: dict[str, Any], world: int, *, seq_len: int, npus_per_node: int = 8,
                  shape: TrainShape = FULL_FT, usable: int = PLANNED_BYTES, tps: tuple[int, ...] = TP_CANDIDATES,
                  stages: tuple[int, ...] = ZERO_CANDIDATES) -> str:
    """Why no layout of ``world`` devices fits and what would: the smallest world, a shorter sequence, LoRA."""
    def choice(w: int, s: int) -> LayoutChoice:
        return choose_layout(cfg, w, seq_len=s, npus_per_node=npus_per_node, shape=shape, usable=usable, tps=tps,
                             stages=stages)

    need, fit = smallest_world(cfg, seq_len=seq_len, npus_per_node=npus_per_node, shape=shape, usable=usable,
                               stages=stages)
    fixes = [f"{need} NPUs ({math.ceil(need / npus_per_node)} node(s), {fit.label})" if need else
             f"no layout on up to 256 NPUs with ZeRO-{max(stages)} (pipeline stages are not built)"]
    s = seq_len // 2
    while s >= 256 and choice(world, s).tp is None:
        s //= 2
    if s >= 256:
        fixes.append(f"data.seq_len={s}")
    if shape.lora is None:
        fixes.append("LoRA (train.method=lora: fewer states)")
    return f"no layout of {world} NPU(s) fits: {choice(world, seq_len).why}; would fit: " + " or ".join(fixes)


def auto_layout(recipe: Recipe, world: int, npus_per_node: int, device: str) -> dict[str, tuple[int, str]]:
    """``parallel.tp: auto`` and ``parallel.zero: auto`` resolved for ``world`` workers, ``npus_per_node`` of
    them per node: {key: (value, why)} for each that was auto. TP 1 (and the stage left to ``decide``: ZeRO-1
    with DP) on CPU workers and where the model's config.json is not there yet (the tiny default is created
    later) or is unusable (preflight's model row says why); else :func:`choose_layout` with the recipe's
    settings, the other key kept where it is given. Raises :class:`ConfigError` with :func:`no_fit_advice`
    when nothing fits."""
    p = recipe.parallel
    tps = TP_CANDIDATES if p.tp == "auto" else (p.tp_size,)
    stages = ZERO_CANDIDATES if p.zero == "auto" else (int(p.zero),)
    path = Path(resolved_model_dir(recipe) or ".") / "config.json"
    why = "" if PLATFORMS[device].accelerator else "CPU workers (the choice is made for NPU memory)"
    try:
        if not why:
            cfg = json.loads(path.read_text())
            shape = TrainShape.of(recipe, device)
            choice = choose_layout(cfg, world, seq_len=recipe.data.seq_len, npus_per_node=npus_per_node,
                                   shape=shape, tps=tps, stages=stages)
    except FileNotFoundError:
        why = f"no {path} yet to estimate from"
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as e:  # ValueError: JSON, another family
        why = f"{path} unusable for the estimate ({type(e).__name__}: {e})"
    if why:
        return {"parallel.tp": (1, f"auto -> 1: {why}")} if p.tp == "auto" else {}
    if choice.tp is None:
        advice = no_fit_advice(cfg, world, seq_len=recipe.data.seq_len, npus_per_node=npus_per_node, shape=shape,
                               tps=tps, stages=stages)
        key = "parallel.tp" if p.tp == "auto" else "parallel.zero"
        raise ConfigError([Problem(key, f"auto: {advice}", value="'auto'")])
    chosen = f"auto -> {choice.why}; {MARGIN_NOTE}"
    out = {"parallel.tp": (choice.tp, chosen)} if p.tp == "auto" else {}
    if p.zero == "auto":
        traffic = traffic_line(cfg, choice.tp, choice.dp, shape, npus_per_node)
        why = "the lowest stage that fits, ZeRO-3 only where nothing else does" + ("" if out else f": {choice.why}")
        out["parallel.zero"] = (choice.zero, f"auto -> ZeRO-{choice.zero} ({choice.label}; {why}); {traffic}")
    return out
