"""Per-device memory estimate for a full fine-tune (pure Python; the launcher imports it).

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

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jobspec.qwen2_layout import Dims, local_kv_heads, local_shapes

if TYPE_CHECKING:
    from jobspec.config import Recipe

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
                    vocab_parallel: bool = False, loss_chunk_tokens: int = 0) -> MemoryEstimate:
    """Predict bytes per device from a Hugging Face Qwen2 config dict and the layout."""
    if precision not in _DTYPE_BYTES:
        raise ValueError(f"train.precision={precision!r}: one of bf16, fp16, fp32 for the estimate")
    nbytes = _DTYPE_BYTES[precision]
    n = sum(math.prod(s) for s in local_shapes(model_config, tp, vocab_parallel).values())
    sharded = shard_optimizer and dp > 1
    state = shard_elements(n, dp) if sharded else n
    master = state * 4 if precision != "fp32" else 0  # fp32 params are their own master
    tokens = seq_len * micro_batch_size
    h, layers, vocab = model_config["hidden_size"], model_config["num_hidden_layers"], model_config["vocab_size"]
    per_layer = _layer_activation_elems(model_config, tp) * tokens * nbytes
    acts = layers * tokens * h * nbytes + per_layer if recompute else layers * per_layer
    head_tokens = min(tokens, loss_chunk_tokens) if loss_chunk_tokens > 0 else tokens
    acts += head_tokens * (vocab // tp if vocab_parallel else vocab) * (3 * 4 + nbytes)
    # gradients are accumulated and reduced in fp32 whatever the compute dtype (finetune/train.py accumulate)
    return MemoryEstimate(weights=n * nbytes, grads=n * 4, master=master, optimizer=2 * state * 4,
                          activations=acts, workspace=WORKSPACE_BYTES)


def memory_estimate(recipe: Recipe, cfg: dict[str, Any],
                    estimator: Callable[..., MemoryEstimate] = estimate_memory) -> MemoryEstimate:
    """The per-device estimate of a resolved recipe's layout on the model of ``cfg`` (config.json);
    preflight prints it, the trainer compares it with the measured peak at step 1."""
    p, t = recipe.parallel, recipe.train
    return estimator(cfg, seq_len=recipe.data.seq_len, micro_batch_size=t.micro_batch_size, tp=p.tp, dp=p.dp,
                     precision=t.precision, recompute=t.recompute, shard_optimizer=p.shard_optimizer,
                     vocab_parallel=p.vocab_parallel, loss_chunk_tokens=t.loss_chunk_tokens)
