"""Per-device memory estimate for a full or LoRA fine-tune (pure Python; the launcher imports it).

Weights, gradients, fp32 master weights and Adam moments are exact element counts of the local
tensors under the layout (the TP split rules of ``jobspec.qwen2_layout``, which the model uses too;
the same bucket partition as the sharded optimizer). Activations and workspace are an estimate:

* full recompute: every layer's input is kept (b*s*H), plus one layer's activations while it is
  recomputed in backward (flash attention: no s*s score matrix);
* no recompute: every layer's activations are kept;
* the LM head + cross-entropy at its backward peak: three fp32 buffers (logits, exponentials,
  softmax - onehot) and its compute-dtype copy over ``min(b*s, train.loss_chunk_tokens)`` tokens
  and the local vocabulary rows (V/tp when vocab-parallel);
* workspace: a fixed allowance for the framework, HCCL buffers and allocator fragmentation.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobspec.config import ConfigError, Problem, Recipe, TrainConfig, resolved_model_dir
from jobspec.lora_config import LoraConfig, trainable_elements
from jobspec.qwen2_layout import Dims, local_kv_heads, local_shapes

BUCKET_BYTES = 25 * 2**20  # gradient/optimizer collective bucket (about 25 MB): finetune.dist uses it

WORKSPACE_BYTES = 1_500_000_000
_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass
class MemoryEstimate:
    """Bytes per device, by part."""

    weights: int
    grads: int
    master: int
    optimizer: int
    activations: int
    workspace: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.master + self.optimizer + self.activations + self.workspace

    def table(self) -> str:
        rows = [(k, getattr(self, k)) for k in ("weights", "grads", "master", "optimizer", "activations",
                                                 "workspace")] + [("total", self.total)]
        head = f"{'part':<12}{'GB':>10}{'GiB':>10}"
        return "\n".join([head] + [f"{k:<12}{v / 1e9:10.2f}{v / 2**30:10.2f}" for k, v in rows])


def shard_elements(total: int, dp: int, bucket_bytes: int = BUCKET_BYTES) -> int:
    """fp32 elements one DP rank holds in the sharded optimizer (its chunk of every padded bucket)."""
    per = max(1, bucket_bytes // 4)
    return sum(math.ceil((min(a + per, total) - a) / dp) for a in range(0, total, per))


def _layer_activation_elems(cfg: dict[str, Any], tp: int) -> int:
    """Activation elements per token that one layer keeps for backward (flash attention)."""
    d = Dims.of(cfg)
    replicated = 5 * d.hidden  # norm inputs/outputs and the residual
    heads = d.heads // tp
    split = 2 * (heads + 2 * local_kv_heads(cfg, tp)) * d.head_dim + 2 * heads * d.head_dim + 4 * (d.inter // tp)
    return replicated + split


def estimate_memory(model_config: dict[str, Any], *, seq_len: int, micro_batch_size: int, tp: int = 1, dp: int = 1,
                    precision: str = "bf16", recompute: bool = True, shard_optimizer: bool = False,
                    vocab_parallel: bool = False, loss_chunk_tokens: int = 0,
                    lora: LoraConfig | None = None) -> MemoryEstimate:
    """Predict bytes per device from a Hugging Face Qwen2 config dict and the layout. ``lora`` (a
    LoraConfig, train.method=lora): the base is frozen in the compute dtype; only the fp32 adapters
    (and modules_to_save, with fp32 masters) have gradients and optimizer state."""
    if precision not in _DTYPE_BYTES:
        raise ValueError(f"train.precision={precision!r}: one of bf16, fp16, fp32 for the estimate")
    nbytes = _DTYPE_BYTES[precision]
    n = sum(math.prod(s) for s in local_shapes(model_config, tp, vocab_parallel).values())
    adapters, saved = trainable_elements(model_config, lora, tp, vocab_parallel) if lora else (0, n)
    trained = adapters + saved
    sharded = shard_optimizer and dp > 1
    state = shard_elements(trained, dp) if sharded else trained
    # fp32 params are their own master; adapters always are
    master = (shard_elements(saved, dp) if sharded else saved) * 4 if precision != "fp32" else 0
    tokens = seq_len * micro_batch_size
    h, layers, vocab = model_config["hidden_size"], model_config["num_hidden_layers"], model_config["vocab_size"]
    per_layer = _layer_activation_elems(model_config, tp) * tokens * nbytes
    acts = layers * tokens * h * nbytes + per_layer if recompute else layers * per_layer
    head_tokens = min(tokens, loss_chunk_tokens) if loss_chunk_tokens > 0 else tokens
    acts += head_tokens * (vocab // tp if vocab_parallel else vocab) * (3 * 4 + nbytes)
    # gradients are accumulated and reduced in fp32 whatever the compute dtype (finetune/train.py accumulate)
    if lora is not None and lora.dropout > 0:  # each adapter keeps its dropped input (column: whole, row: split)
        d = Dims.of(model_config)
        inputs = 5 * d.hidden + (d.heads * d.head_dim + d.inter) // tp
        acts += (layers if not recompute else 1) * tokens * inputs * nbytes
    return MemoryEstimate(weights=n * nbytes + adapters * 4, grads=trained * 4, master=master, optimizer=2 * state * 4,
                          activations=acts, workspace=WORKSPACE_BYTES)


def memory_estimate(recipe: Recipe, cfg: dict[str, Any],
                    estimator: Callable[..., MemoryEstimate] = estimate_memory) -> MemoryEstimate:
    """The per-device estimate of a resolved recipe's layout on the model of ``cfg`` (config.json): its
    :class:`TrainShape` (as ``parallel.tp: auto`` estimates it) at the layout's TP, DP and sequence; preflight
    prints it, the trainer compares it with the measured peak at step 1."""
    layout = recipe.decided_layout
    return TrainShape.of(recipe, layout.device).estimate(cfg, layout.tp, layout.dp, layout.seq_len, estimator)


# ---------------------------------------------------------------------------- choosing the layout

NPU_USABLE_BYTES = 60 * 2**30  # of a 64 GB 910B's HBM, what a job may plan with (the rest: runtime, HCCL)
# What the layout choice plans with: 90% of the usable memory, a margin for the allocator's fragmentation
# and the estimate's error (not yet compared with a 910B's measured peak); an explicit parallel.tp may use all.
PLANNED_BYTES = NPU_USABLE_BYTES * 9 // 10
TP_CANDIDATES = (1, 2, 4, 8)


@dataclass
class LayoutChoice:
    """A layout that fits (``tp`` None: none does) and why it was chosen."""

    tp: int | None
    dp: int
    estimate: MemoryEstimate | None
    why: str


@dataclass(frozen=True)
class TrainShape:
    """What the estimate takes of a recipe besides the layout and the sequence; the defaults are how the NPU
    recipes fully fine-tune (micro batch 1, recompute, the optimizer sharded over DP, vocab-parallel with
    TP > 1, the loss over chunks of ``train.loss_chunk_tokens``' default)."""

    precision: str = "bf16"
    micro_batch_size: int = 1
    recompute: bool = True
    shard_optimizer: bool = True  # over DP when DP > 1
    vocab_parallel: bool = True  # when TP > 1
    loss_chunk_tokens: int = TrainConfig.loss_chunk_tokens
    lora: LoraConfig | None = None  # train.method=lora

    @classmethod
    def of(cls, recipe: Recipe, device: str) -> TrainShape:
        """The shape of ``recipe`` trained on ``device`` ('npu' | 'cpu')."""
        t, p = recipe.train, recipe.parallel
        return cls(t.precision_on(device), t.micro_batch_size, t.recompute, p.shard_optimizer is not False,
                   p.vocab_parallel, t.loss_chunk_tokens, recipe.lora if t.method == "lora" else None)

    def estimate(self, cfg: dict[str, Any], tp: int, dp: int, seq_len: int,
                 estimator: Callable[..., MemoryEstimate] = estimate_memory) -> MemoryEstimate:
        return estimator(cfg, seq_len=seq_len, micro_batch_size=self.micro_batch_size, tp=tp, dp=dp,
                               precision=self.precision, recompute=self.recompute,
                               shard_optimizer=self.shard_optimizer, vocab_parallel=self.vocab_parallel and tp > 1,
                               loss_chunk_tokens=self.loss_chunk_tokens, lora=self.lora)


FULL_FT = TrainShape()


def choose_tp(cfg: dict[str, Any], world: int, *, seq_len: int, npus_per_node: int = 8,
              shape: TrainShape = FULL_FT, usable: int = PLANNED_BYTES,
              estimator: Callable[..., MemoryEstimate] = estimate_memory) -> LayoutChoice:
    """The smallest TP that divides the heads and KV heads (``tp_problems``), stays inside a node,
    divides ``world`` and makes the estimate of ``shape`` fit ``usable`` bytes per device."""
    from jobspec.qwen2_layout import tp_problems

    refused: list[str] = []
    for tp in TP_CANDIDATES:
        if tp > npus_per_node or world % tp or tp_problems(cfg, tp, vocab_parallel=shape.vocab_parallel and tp > 1):
            continue
        est = shape.estimate(cfg, tp, world // tp, seq_len, estimator)
        if est.total <= usable:
            why = f"TP {tp}: " + ("; ".join(refused) if refused else f"fits ({est.total / 2**30:.1f} GiB per NPU)")
            return LayoutChoice(tp, world // tp, est, why)
        refused.append(f"TP {tp} needs {est.total / 2**30:.1f} GiB per NPU > {usable / 2**30:.0f} planned")
    return LayoutChoice(None, 0, None, "; ".join(refused) or f"no TP up to {npus_per_node} divides the heads")


def smallest_world(cfg: dict[str, Any], *, seq_len: int, npus_per_node: int = 8, shape: TrainShape = FULL_FT,
                   usable: int = PLANNED_BYTES, max_world: int = 256) -> tuple[int, LayoutChoice]:
    """The fewest devices (1, 2, 4, then whole nodes doubling) with a layout that fits; (0, the last
    refusal) when none up to ``max_world`` (32 nodes) does: ZeRO-1 shards only the optimizer state
    over DP, so the replicated bf16 weights and fp32 gradients of a TP 8 slice set a floor."""
    worlds = [w for w in (1, 2, 4) if w < npus_per_node] + \
        [npus_per_node * 2**k for k in range(max_world.bit_length()) if npus_per_node * 2**k <= max_world]
    for world in worlds:
        choice = choose_tp(cfg, world, seq_len=seq_len, npus_per_node=npus_per_node, shape=shape, usable=usable)
        if choice.tp is not None:
            return world, choice
    return 0, LayoutChoice(None, 0, None, f"at {worlds[-1]} NPUs: {choice.why}")


def no_fit_advice(cfg: dict[str, Any], world: int, *, seq_len: int, npus_per_node: int = 8,
                  shape: TrainShape = FULL_FT, usable: int = PLANNED_BYTES) -> str:
    """Why no layout of ``world`` devices fits and what would: the smallest world, a shorter sequence, LoRA."""
    def fits(w: int, s: int) -> bool:
        return choose_tp(cfg, w, seq_len=s, npus_per_node=npus_per_node, shape=shape, usable=usable).tp is not None

    why = choose_tp(cfg, world, seq_len=seq_len, npus_per_node=npus_per_node, shape=shape, usable=usable).why
    need, _ = smallest_world(cfg, seq_len=seq_len, npus_per_node=npus_per_node, shape=shape, usable=usable)
    fixes = [f"{need} NPUs ({math.ceil(need / npus_per_node)} node(s))" if need else
             "more than ZeRO-1 on up to 256 NPUs (it shards only the optimizer state over DP: ZeRO-2/3 or "
             "pipeline stages)"]
    s = seq_len // 2
    while s >= 256 and not fits(world, s):
        s //= 2
    if s >= 256:
        fixes.append(f"data.seq_len={s}")
    if shape.lora is None:
        fixes.append("LoRA (train.method=lora: fewer states)")
    return f"no layout of {world} NPU(s) fits: {why}; would fit: " + " or ".join(fixes)


def auto_tp(recipe: Recipe, world: int, npus_per_node: int, device: str) -> tuple[int, str]:
    """``parallel.tp: auto`` resolved for ``world`` workers, ``npus_per_node`` of them per node: (TP, why).
    1 on CPU workers and where the model's config.json is not there yet (the tiny default is created later)
    or unreadable (preflight's model row says why); else :func:`choose_tp` with the recipe's own settings.
    Raises :class:`ConfigError` with :func:`no_fit_advice` when no TP fits."""
    if device == "cpu":
        return 1, "auto -> 1: CPU workers (the choice is made for NPU memory)"
    path = Path(resolved_model_dir(recipe) or ".") / "config.json"
    try:
        cfg = json.loads(path.read_text())
        shape = TrainShape.of(recipe, device)
        choice = choose_tp(cfg, world, seq_len=recipe.data.seq_len, npus_per_node=npus_per_node, shape=shape)
    except FileNotFoundError:
        return 1, f"auto -> 1: no {path} yet to estimate from"
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as e:  # ValueError: JSON, another family
        return 1, f"auto -> 1: {path} unusable for the estimate ({type(e).__name__}: {e})"
    if choice.tp is None:
        advice = no_fit_advice(cfg, world, seq_len=recipe.data.seq_len, npus_per_node=npus_per_node, shape=shape)
        raise ConfigError([Problem("parallel.tp", f"auto: {advice}", value="'auto'")])
    return choice.tp, f"auto -> {choice.why}"
