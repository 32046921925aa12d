"""The model's fused-kernel ops: each function runs the fused Ascend kernel when ``fused`` (and the
kernel's documented limits are met) and the reference math otherwise (the tested path, and the one
every other device runs).

Activations are BSND: ``[batch, seq, heads, head_dim]``. The fused attention takes packed causal
sequences in the TND layout (``[tokens, heads, head_dim]``, cumulative sequence ends, ``sparse_mode=3``
with the 2048x2048 causal mask) as MindSpore 2.10's ``flash_attention_score`` documents, so no
``[batch, 1, seq, seq]`` mask exists on that path. ``tests/finetune/contracts`` holds the contract of
every kernel called here and a CPU emulator of each that enforces it.
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops
from mindspore.ops import auto_generate

CAUSAL_BLOCK = 2048  # the compressed causal mask of sparse_mode 2/3 is CAUSAL_BLOCK x CAUSAL_BLOCK
MAX_SEQUENCES = 1024  # TND: at most this many sequences per call
FLASH_MAX_HEADS = 256  # query heads per call
FLASH_MAX_HEAD_DIM = 512  # head_dim: a multiple of 16 up to this
ROPE_MAX_HEAD_DIM = 896  # head_dim < this and even
ROPE_MAX_BN = 1000  # B and N < this (rotate_half)


class Packed(NamedTuple):
    """Fused attention spec: cumulative ends of each causal sequence over the flattened batch (host
    ints only: a recomputed layer would take a Tensor in its arguments for an input to differentiate)."""

    ends: tuple[int, ...]


def rms_norm(x, weight, eps: float, fused: bool):
    """``weight * x / sqrt(mean(x^2) + eps)``, the mean in fp32, returned in ``x``'s dtype.

    The fused kernel gets ``x`` and ``weight`` in ``x``'s dtype (aclnnRmsNorm's dtype pairs and
    MindSpore's same-dtype rule both allow that; fp32 ``x`` with bf16 weight is rejected). The primitive
    ``ops.RmsNorm``: 2.10 announces a new signature for the functional ``ops.rms_norm``."""
    dtype = x.dtype
    if fused:
        return ops.RmsNorm(eps)(x, weight.astype(dtype))[0]
    h = x.astype(ms.float32)
    h = h * ops.rsqrt(ops.mean(h * h, -1, True) + eps)
    return weight.astype(dtype) * h.astype(dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return ops.cat((-x[..., half:], x[..., :half]), -1)


def rope_fits(shape: tuple[int, ...]) -> bool:
    """Whether rotary_position_embedding (rotate_half) takes BSND ``x`` of this shape."""
    b, _, n, d = shape
    return d % 2 == 0 and d < ROPE_MAX_HEAD_DIM and b < ROPE_MAX_BN and n < ROPE_MAX_BN


def rope(x, cos, sin, fused: bool):
    """Rotary position embedding (rotate-half form) of BSND ``x`` with ``cos``/``sin`` ``[b, s, 1, d]``
    in ``x``'s dtype; the fused kernel only within its documented size limits. The primitive that the
    functional ``ops.rotary_position_embedding`` (deprecated after 2.9.0 in 2.10) calls."""
    if fused and rope_fits(x.shape):
        return auto_generate.RotaryPositionEmbedding()(x, cos, sin, 0)
    return x * cos + _rotate_half(x) * sin


def flash_fits(dtype, head_dim: int, heads: int, kv_heads: int) -> bool:
    """Whether flash_attention_score takes these heads (fp16/bf16 only)."""
    return (dtype in (ms.float16, ms.bfloat16) and head_dim % 16 == 0 and head_dim <= FLASH_MAX_HEAD_DIM
            and heads <= FLASH_MAX_HEADS and heads % kv_heads == 0)


@lru_cache(maxsize=1)
def causal_block() -> Tensor:
    """The 2048x2048 mask of sparse_mode 3: 1 (not attended) strictly above the diagonal."""
    return Tensor(np.triu(np.ones((CAUSAL_BLOCK, CAUSAL_BLOCK), np.uint8), 1))


def sequence_ends(segment_ids: np.ndarray) -> tuple[int, ...]:
    """Cumulative ends of the runs of equal segment id in each row, rows laid end to end (padding,
    segment 0, is a run of its own: its outputs carry no label)."""
    b, s = segment_ids.shape
    cut = np.ones((b, s), np.bool_)  # a run ends before a change of segment and at each row end
    cut[:, :-1] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return tuple(int(i) + 1 for i in np.flatnonzero(cut))


def packed(segment_ids: np.ndarray) -> Packed | None:
    """The fused attention spec of a batch, or None when it has more sequences than one call takes."""
    ends = sequence_ends(segment_ids)
    return Packed(ends) if len(ends) <= MAX_SEQUENCES else None


def attention(q, k, v, heads: int, kv_heads: int, mask, scale: float):
    """``softmax(q k^T * scale + mask) v`` of BSND ``q`` ``[b, s, heads, d]`` and ``k``/``v``
    ``[b, s_kv, kv_heads, d]`` (GQA), returned BSND.

    ``mask``: a ``Packed`` spec (fused, s_kv == s) or the reference ``[b, 1, s, s_kv]`` fp32 mask,
    large negative where masked."""
    b, s, _, d = q.shape
    if not isinstance(mask, Tensor):  # the Packed spec (a recomputed layer gets it as a plain tuple)
        ends = tuple(mask[0])
        out = ops.flash_attention_score(
            q.reshape(b * s, heads, d), k.reshape(b * s, kv_heads, d), v.reshape(b * s, kv_heads, d), heads,
            attn_mask=causal_block(), actual_seq_qlen=ends, actual_seq_kvlen=ends, scalar_value=scale,
            next_tokens=0, input_layout="TND", sparse_mode=3)
        return out.reshape(b, s, heads, d)
    q, k, v = q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2)  # BNSD
    rep = heads // kv_heads
    if rep > 1:
        k = ops.repeat_interleave(k, rep, 1)
        v = ops.repeat_interleave(v, rep, 1)
    scores = ops.matmul(q, k.swapaxes(-1, -2)).astype(ms.float32) * scale + mask
    probs = ops.softmax(scores, -1).astype(v.dtype)
    return ops.matmul(probs, v).swapaxes(1, 2)


def swiglu(gate, up, fused: bool):
    """``silu(gate) * up``."""
    if fused:
        return ops.swiglu(ops.cat((gate, up), -1), -1)
    return ops.silu(gate) * up
