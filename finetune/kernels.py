"""The model's fused-kernel ops: each function runs the fused Ascend kernel when ``fused`` and the
reference math (the tested one, and the one every other device runs) otherwise."""
from __future__ import annotations

import mindspore as ms
from mindspore import ops


def rms_norm(x, weight, eps: float, fused: bool):
    """``weight * x / sqrt(mean(x^2) + eps)`` computed in fp32, returned in ``x``'s dtype."""
    dtype = x.dtype
    if fused:
        return ops.rms_norm(x.astype(ms.float32), weight, eps)[0].astype(dtype)
    h = x.astype(ms.float32)
    h = h * ops.rsqrt(ops.mean(h * h, -1, keep_dims=True) + eps)
    return weight.astype(dtype) * h.astype(dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return ops.cat((-x[..., half:], x[..., :half]), -1)


def rope(x, cos, sin, fused: bool):
    """Rotary position embedding (rotate-half form) of ``x`` ``[b, heads, s, head_dim]``."""
    if fused:
        return ops.rotary_position_embedding(x, cos, sin, 0)
    return x * cos + _rotate_half(x) * sin


def attention(q, k, v, heads: int, kv_heads: int, mask, scale: float, fused: bool):
    """``softmax(q k^T * scale + mask) v`` over BNSD ``q`` ``[b, heads, s, d]`` and ``k``/``v``
    ``[b, kv_heads, s_kv, d]`` (GQA); ``mask`` ``[b, 1, s, s_kv]`` fp32, large negative where masked."""
    if fused:  # GQA native: key/value keep kv_heads; mask 1 = not attended
        return ops.flash_attention_score(q, k, v, heads, attn_mask=(mask < 0).astype(ms.uint8),
                                         scalar_value=scale, input_layout="BNSD")
    rep = heads // kv_heads
    if rep > 1:
        k = ops.repeat_interleave(k, rep, 1)
        v = ops.repeat_interleave(v, rep, 1)
    scores = ops.matmul(q, k.swapaxes(-1, -2)).astype(ms.float32) * scale + mask
    probs = ops.softmax(scores, -1).astype(v.dtype)
    return ops.matmul(probs, v)


def swiglu(gate, up, fused: bool):
    """``silu(gate) * up``."""
    if fused:
        return ops.swiglu(ops.cat((gate, up), -1), -1)
    return ops.silu(gate) * up
