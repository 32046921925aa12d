"""Contract twins of the fused Ascend kernels the model calls: CPU emulators that enforce each
kernel's documented contract, then compute the reference math in fp32 (cast back to the kernel's
output dtype). The self-test runs the model's fused calls against them on CPU; the tests import them
from here (``tests/finetune/contracts/twins.py`` adds the optimizer and collective twins).

``CONTRACTS`` is the one table of the rules, each citing its source:

- ``MS-FA``: MindSpore 2.10 ``ops.flash_attention_score`` docstring
  (``mindspore/ops/operations/manually_defined/ops_def.py``, shipped in the 2.10.0 wheel).
- ``MS-RMS``, ``MS-ROPE``, ``MS-SWIGLU``: MindSpore 2.10 ``ops.rms_norm`` (``ops.RmsNorm``) /
  ``ops.rotary_position_embedding`` (its primitive ``RotaryPositionEmbedding``) / ``ops.swiglu``
  docstrings (``mindspore/ops/auto_generate/gen_ops_def.py``).
- ``ACLNN-RMS``: CANN ops-nn ``norm/rms_norm/docs/aclnnRmsNorm.md``, "Constraints": the (x, gamma)
  dtype table for Atlas A2/A3 training products.
- ``ACLNN-ROPE``: CANN ops-transformer ``posembedding/rotary_position_embedding/docs/
  aclnnRotaryPositionEmbedding.md``, 约束说明 (constraints) for Atlas A2/A3.
- ``ACLNN-ROPE-TILING``: CANN ops-transformer ``posembedding/rotary_position_embedding/op_host/
  rope_rotate_half_tiling.cpp`` (``ChooseTilingMode``, ``GetAlignedInfo``, ``CheckBnsdBlockSkip``): the
  layout the kernel actually takes from the shapes, and when it refuses a BNSD reading. 48 is the most
  vector cores a 910B has (24 AI cores x 2); the twin refuses whenever some 910B would.

The model calls ``ops.RmsNorm(epsilon)(x, gamma)`` and ``RotaryPositionEmbedding()(x, cos, sin, mode)``
(``mindspore.ops.auto_generate``): the 2.10 functionals ``ops.rms_norm`` (signature change announced)
and ``ops.rotary_position_embedding`` (deprecated after 2.9.0) call the same primitives.
``install_fused(patch)`` puts the twins in their place; modes the model never uses (dropout, pse,
prefix, layouts other than TND, interleaved RoPE) are refused as not emulated.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops
from mindspore.ops import auto_generate


class Rule(NamedTuple):
    text: str
    source: str


CONTRACTS: dict[tuple[str, str], Rule] = {
    # flash_attention_score
    ("flash_attention_score", "dtype"): Rule("query is float16 or bfloat16; key and value have query's dtype",
                                             "MS-FA Args query/key/value, Raises"),
    ("flash_attention_score", "tnd_shape"): Rule("TND: query (T1, N1, D), key and value (T2, N2, D), value shaped "
                                                 "as key", "MS-FA Args query/key/value"),
    ("flash_attention_score", "head_num"): Rule("head_num equals N1, 1 <= N1 <= 256", "MS-FA N1, head_num"),
    ("flash_attention_score", "gqa"): Rule("N2 is a factor of N1", "MS-FA N2; Raises RuntimeError"),
    ("flash_attention_score", "head_dim"): Rule("D is the same in query, key and value, a multiple of 16, at most "
                                                "512", "MS-FA D; Raises RuntimeError"),
    ("flash_attention_score", "seq_given"): Rule("TND: actual_seq_qlen and actual_seq_kvlen are given, lists of "
                                                 "the same length (the batch), at most 1024",
                                                 "MS-FA input_layout TND restrictions"),
    ("flash_attention_score", "seq_cumulative"): Rule("actual_seq_qlen / actual_seq_kvlen are cumulative sums: "
                                                      "increasing, last value T1 / T2, no empty key sequence",
                                                      "MS-FA actual_seq_qlen/actual_seq_kvlen; TND restrictions"),
    ("flash_attention_score", "mask_dtype"): Rule("attn_mask is bool or uint8; 1/True = discard, 0/False = keep",
                                                  "MS-FA attn_mask; Raises TypeError"),
    ("flash_attention_score", "tnd_mask"): Rule("TND: sparse_mode 2 or 3 with the (2048, 2048) lower-triangular "
                                                "mask (1 strictly above the diagonal)",
                                                "MS-FA TND restrictions; attn_mask compression scenario"),
    ("flash_attention_score", "tnd_tokens"): Rule("TND: next_tokens is 0 and pre_tokens >= max_seqlen_q",
                                                  "MS-FA TND restrictions"),
    ("flash_attention_score", "sparse3"): Rule("sparse_mode 3 (rightDownCausal): each S1 <= S2",
                                               "MS-FA TND restrictions"),
    ("flash_attention_score", "scalars"): Rule("scalar_value and keep_prob are floats in range (keep_prob (0, 1]), "
                                               "sparse_mode an int, input_layout a string",
                                               "MS-FA Raises TypeError"),
    ("flash_attention_score", "sizes"): Rule("sequence lengths 1..512k, batch 1..2k", "MS-FA B, S1, S2"),
    ("flash_attention_score", "emulated"): Rule("the twin emulates TND, no dropout/pse/prefix (keep_prob 1.0, "
                                                "real_shift/drop_mask/padding_mask/prefix None)", "twin scope"),
    # rms_norm
    ("rms_norm", "dtype_pair"): Rule("(x, gamma) dtypes are one of (fp16, fp32), (bf16, fp32), (fp16, fp16), "
                                     "(bf16, bf16), (fp32, fp32)", "ACLNN-RMS Constraints, Atlas A2 table"),
    ("rms_norm", "same_dtype"): Rule("x and gamma have the same dtype", "MS-RMS Raises TypeError"),
    ("rms_norm", "shape"): Rule("x has 1-8 dims; gamma shape == x.shape[n:], n < x.ndim",
                                "ACLNN-RMS gamma; MS-RMS Raises ValueError"),
    ("rms_norm", "epsilon"): Rule("epsilon is a float in (0, 1]", "MS-RMS epsilon"),
    # rotary_position_embedding
    ("rotary_position_embedding", "dtype"): Rule("x is float16, bfloat16 or float32; cos and sin have x's dtype",
                                                 "MS-ROPE Args; ACLNN-ROPE cos/sin"),
    ("rotary_position_embedding", "rank"): Rule("x, cos and sin are 4-D; cos and sin have the same shape",
                                                "MS-ROPE Args; ACLNN-ROPE constraints"),
    ("rotary_position_embedding", "mode"): Rule("mode is 0 (rotate_half); the twin emulates only that", "MS-ROPE mode"),
    ("rotary_position_embedding", "head_dim"): Rule("D is the same in x, cos, sin; even and < 896",
                                                    "MS-ROPE layout table; ACLNN-ROPE A2 constraints"),
    ("rotary_position_embedding", "layout"): Rule("cos/sin layout: x BNSD -> 11SD, B1SD, BNSD; x BSND -> 1S1D, BS1D, "
                                                  "BSND; x SBND -> S11D, SB1D, SBND; with B, N < 1000 in that reading",
                                                  "MS-ROPE layout table; ACLNN-ROPE half mode"),
    ("rotary_position_embedding", "bnsd"): Rule("when the kernel's tiling reads x as BNSD (B, N, S its first three "
                                                "dims): not with D/2 32-byte aligned and B * N > 8 * S, nor with D/2 "
                                                "unaligned, D < 80 and 2 * B * N > ceil(S / 48 vector cores)",
                                                "ACLNN-ROPE-TILING CheckBnsdBlockSkip, GetAlignedInfo; MS-ROPE note"),
    # swiglu
    ("swiglu", "dtype"): Rule("input is float16, float32 or bfloat16", "MS-SWIGLU Raises TypeError"),
    ("swiglu", "split"): Rule("the size of dim is divisible by 2", "MS-SWIGLU Raises RuntimeError"),
}


class ContractError(AssertionError):
    """A call that the real Ascend kernel would refuse (or that its documents forbid)."""


def need(op: str, key: str, ok: bool, got: str, table: dict[tuple[str, str], Rule] | None = None) -> None:
    """Raise ContractError quoting the rule of ``table`` (default :data:`CONTRACTS`) and its source unless ``ok``."""
    if not ok:
        rule = (table or CONTRACTS)[(op, key)]
        raise ContractError(f"{op}: {rule.text} [{rule.source}]; got {got}")


HALF = (ms.float16, ms.bfloat16)
FLOATS = (ms.float16, ms.float32, ms.bfloat16)


def _ints(x) -> list[int] | None:
    if x is None:
        return None
    if isinstance(x, Tensor):
        return [int(v) for v in x.asnumpy().reshape(-1)]
    if isinstance(x, (list, tuple)) and all(isinstance(v, (int, np.integer)) for v in x):
        return [int(v) for v in x]
    raise ContractError(f"flash_attention_score: actual_seq_*len must be a Tensor or a tuple/list of ints, got {x!r}")


def _lengths(ends: list[int]) -> list[int]:
    return [b - a for a, b in zip([0] + ends[:-1], ends)]


def flash_attention_score(query, key, value, head_num, real_shift=None, drop_mask=None, padding_mask=None,
                          attn_mask=None, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, keep_prob=1.0,
                          scalar_value=1.0, pre_tokens=2147483647, next_tokens=2147483647, inner_precise=0,
                          input_layout="BSH", sparse_mode=0):
    op = "flash_attention_score"
    need(op, "scalars", isinstance(scalar_value, float) and isinstance(keep_prob, float) and 0 < keep_prob <= 1
         and isinstance(sparse_mode, int) and isinstance(input_layout, str),
         f"scalar_value={scalar_value!r}, keep_prob={keep_prob!r}, sparse_mode={sparse_mode!r}")
    need(op, "emulated", input_layout == "TND" and keep_prob == 1.0 and real_shift is None and drop_mask is None
         and padding_mask is None and prefix is None, f"input_layout={input_layout!r}, keep_prob={keep_prob}")
    need(op, "dtype", query.dtype in HALF and key.dtype == query.dtype and value.dtype == query.dtype,
         f"query {query.dtype}, key {key.dtype}, value {value.dtype}")
    need(op, "tnd_shape", query.ndim == 3 and key.ndim == 3 and value.shape == key.shape,
         f"query {query.shape}, key {key.shape}, value {value.shape}")
    (t1, n1, d), (t2, n2, d2) = query.shape, key.shape
    need(op, "head_num", head_num == n1 and 1 <= n1 <= 256, f"head_num={head_num}, N1={n1}")
    need(op, "gqa", n1 % n2 == 0, f"N1={n1}, N2={n2}")
    need(op, "head_dim", d == d2 and d % 16 == 0 and d <= 512, f"D={d} (query), {d2} (key)")
    q_ends, kv_ends = _ints(actual_seq_qlen), _ints(actual_seq_kvlen)
    need(op, "seq_given", q_ends is not None and kv_ends is not None and len(q_ends) == len(kv_ends)
         and 1 <= len(q_ends) <= 1024, f"actual_seq_qlen={q_ends}, actual_seq_kvlen={kv_ends}")
    q_lens, kv_lens = _lengths(q_ends), _lengths(kv_ends)
    need(op, "seq_cumulative", min(q_lens) >= 0 and min(kv_lens) > 0 and q_ends[-1] == t1 and kv_ends[-1] == t2,
         f"actual_seq_qlen={q_ends} (T1={t1}), actual_seq_kvlen={kv_ends} (T2={t2})")
    need(op, "sizes", max(q_lens + kv_lens) <= 512 * 1024 and len(q_lens) <= 2048, f"lengths {q_lens}, {kv_lens}")
    need(op, "mask_dtype", attn_mask is not None and attn_mask.dtype in (ms.bool_, ms.uint8),
         f"attn_mask {None if attn_mask is None else attn_mask.dtype}")
    block = attn_mask.asnumpy().astype(bool)
    need(op, "tnd_mask", sparse_mode in (2, 3) and block.shape == (2048, 2048)
         and np.array_equal(block, np.triu(np.ones((2048, 2048), bool), 1)),
         f"sparse_mode={sparse_mode}, attn_mask {tuple(block.shape)}")
    need(op, "tnd_tokens", next_tokens == 0 and pre_tokens >= max(q_lens),
         f"next_tokens={next_tokens}, pre_tokens={pre_tokens}, max_seqlen_q={max(q_lens)}")
    need(op, "sparse3", sparse_mode != 3 or all(a <= b for a, b in zip(q_lens, kv_lens)), f"{q_lens} vs {kv_lens}")
    # reference: block-diagonal causal (sparse 3: aligned at the bottom right, 2: at the top left)
    allowed = np.zeros((t1, t2), bool)
    for qa, qn, ka, kn in zip(np.cumsum([0] + q_lens[:-1]), q_lens, np.cumsum([0] + kv_lens[:-1]), kv_lens):
        shift = kn - qn if sparse_mode == 3 else 0
        allowed[qa:qa + qn, ka:ka + kn] = np.tril(np.ones((qn, kn), bool), shift)
    bias = Tensor(np.where(allowed, 0.0, -1e30).astype(np.float32))
    q = query.astype(ms.float32).swapaxes(0, 1)  # [N1, T1, D]
    k = ops.repeat_interleave(key.astype(ms.float32), n1 // n2, 1).swapaxes(0, 1)
    v = ops.repeat_interleave(value.astype(ms.float32), n1 // n2, 1).swapaxes(0, 1)
    probs = ops.softmax(ops.matmul(q, k.swapaxes(1, 2)) * scalar_value + bias, -1)
    return ops.matmul(probs, v).swapaxes(0, 1).astype(query.dtype)


def rms_norm(x, gamma, epsilon=1e-6):
    op = "rms_norm"
    pairs = {(ms.float16, ms.float32), (ms.bfloat16, ms.float32), (ms.float16, ms.float16),
             (ms.bfloat16, ms.bfloat16), (ms.float32, ms.float32)}
    need(op, "dtype_pair", (x.dtype, gamma.dtype) in pairs, f"x {x.dtype}, gamma {gamma.dtype}")
    need(op, "same_dtype", x.dtype == gamma.dtype, f"x {x.dtype}, gamma {gamma.dtype}")
    n = x.ndim - gamma.ndim
    need(op, "shape", 1 <= x.ndim <= 8 and 0 <= n < x.ndim and tuple(x.shape[n:]) == tuple(gamma.shape),
         f"x {x.shape}, gamma {gamma.shape}")
    need(op, "epsilon", isinstance(epsilon, float) and 0 < epsilon <= 1, f"epsilon={epsilon!r}")
    h = x.astype(ms.float32)
    axes = tuple(range(n, x.ndim))
    rstd = ops.rsqrt(ops.mean(h * h, axes, True) + epsilon)
    return (h * rstd * gamma.astype(ms.float32)).astype(x.dtype), rstd


def _rope_readings(x: tuple, r: tuple) -> list[tuple[str, int, int, int]]:
    """(layout, B, N, S) of every documented layout whose cos/sin pattern ``r`` matches for ``x``."""
    a, b, c, _ = x
    out = []
    for layout, pats, (bb, nn, ss) in (("BNSD", [(1, 1, c), (a, 1, c), (a, b, c)], (a, b, c)),
                                       ("BSND", [(1, b, 1), (a, b, 1), (a, b, c)], (a, c, b)),
                                       ("SBND", [(a, 1, 1), (a, b, 1), (a, b, c)], (b, c, a))):
        if tuple(r[:3]) in pats:
            out.append((layout, bb, nn, ss))
    return out


def rope_tiling_mode(x: tuple, r: tuple) -> str:
    """The layout rotate_half's tiling takes for ``x`` and cos/sin ``r`` (first match, in the kernel's order)."""
    (x1, x2, x3), (r1, r2, r3) = x[:3], r[:3]
    for mode, hit in (("no broadcast", (r1, r2, r3) == (x1, x2, x3)), ("BND", (r1, r2, r3) == (1, 1, 1)),
                      ("BNSD", x1 != r1 and x2 != r2), ("BSND", x1 != r1 and x3 != r3),
                      ("SBND", x2 != r2 and x3 != r3), ("x B1SD/BS1D", x1 != r1 and 1 in (r2, r3)),
                      ("x SB1D", x2 != r2 and r3 == 1), ("cos BS1D/SB1D", r3 != x3 and (r1, r2) == (x1, x2)),
                      ("cos B1SD", r2 != x2 and (r1, r3) == (x1, x3))):
        if hit:
            return mode
    return "unknown"


def _bnsd_refused(x: tuple, r: tuple, byte: int) -> bool:
    if rope_tiling_mode(x, r) != "BNSD":
        return False
    b, n, s, d = x
    aligned = (d // 2) % (32 // byte) == 0
    return b * n > 8 * s if aligned else d < 80 and 2 * b * n > -(-s // 48)


def rotary_position_embedding(x, cos, sin, mode=0):
    op = "rotary_position_embedding"
    need(op, "dtype", x.dtype in FLOATS and cos.dtype == x.dtype and sin.dtype == x.dtype,
         f"x {x.dtype}, cos {cos.dtype}, sin {sin.dtype}")
    need(op, "rank", x.ndim == 4 and cos.ndim == 4 and cos.shape == sin.shape, f"x {x.shape}, cos {cos.shape}, "
         f"sin {sin.shape}")
    need(op, "mode", mode == 0, f"mode={mode}")
    d = x.shape[3]
    need(op, "head_dim", cos.shape[3] == d and d % 2 == 0 and d < 896, f"D={d}, cos D={cos.shape[3]}")
    readings = _rope_readings(tuple(x.shape), tuple(cos.shape))
    fits = [(lay, b, n, s) for lay, b, n, s in readings if b < 1000 and n < 1000]
    need(op, "layout", bool(fits), f"x {x.shape}, cos {cos.shape}")
    need(op, "bnsd", not _bnsd_refused(tuple(x.shape), tuple(cos.shape), 4 if x.dtype == ms.float32 else 2),
         f"x {x.shape} read as BNSD, cos {cos.shape}")
    h = x.astype(ms.float32)
    half = d // 2
    rotated = ops.cat((-h[..., half:], h[..., :half]), -1)
    return (h * cos.astype(ms.float32) + rotated * sin.astype(ms.float32)).astype(x.dtype)


def swiglu(input, dim=-1):  # MindSpore's argument name
    op = "swiglu"
    need(op, "dtype", input.dtype in FLOATS, f"input {input.dtype}")
    need(op, "split", input.shape[dim] % 2 == 0, f"shape {input.shape}, dim {dim}")
    a, b = ops.chunk(input.astype(ms.float32), 2, dim)
    return (ops.silu(a) * b).astype(input.dtype)


FUSED: dict[str, Callable[..., Any]] = {"flash_attention_score": flash_attention_score, "rms_norm": rms_norm,
         "rotary_position_embedding": rotary_position_embedding, "swiglu": swiglu}


def counted(name: str, fn: Callable, calls: dict[str, int]) -> Callable:
    """``fn`` that counts its calls in ``calls[name]``."""
    def wrapper(*a, **kw):
        calls[name] = calls.get(name, 0) + 1
        return fn(*a, **kw)
    return wrapper


def install_fused(patch=setattr, fns: dict[str, Callable] | None = None) -> dict[str, int]:
    """Put the twins (or ``fns``, same keys as :data:`FUSED`) where the model calls the fused kernels
    (``patch``: ``monkeypatch.setattr`` in tests, plain ``setattr`` in a process of its own); returns
    the call count of each op."""
    calls: dict[str, int] = {}
    fns = {**FUSED, **(fns or {})}
    rms, rope = counted("rms_norm", fns["rms_norm"], calls), counted("rotary_position_embedding",
                                                                    fns["rotary_position_embedding"], calls)

    class RmsNorm:
        def __init__(self, epsilon=1e-6):
            self.epsilon = epsilon

        def __call__(self, x, gamma):
            return rms(x, gamma, self.epsilon)

    class RotaryPositionEmbedding:
        def __call__(self, x, cos, sin, mode=0):
            return rope(x, cos, sin, mode)

    patch(ops, "flash_attention_score", counted("flash_attention_score", fns["flash_attention_score"], calls))
    patch(ops, "swiglu", counted("swiglu", fns["swiglu"], calls))
    patch(ops, "RmsNorm", RmsNorm)
    patch(auto_generate, "RotaryPositionEmbedding", RotaryPositionEmbedding)
    return calls
