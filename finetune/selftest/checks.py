"""The self-test's single-device checks: each runs one fused call the way the model makes it (through
``finetune.model.kernels``, ``finetune.optim.AdamW`` or the model itself) and returns (device results,
fp32 references computed with numpy on the host).

Big operands are compared on sampled rows/columns (``ROWS``): the device computes the full operation
at the real shape, the host only what the comparison needs, so a check costs seconds, not minutes.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from finetune.dist import RankInfo
from finetune.model import kernels
from jobspec.platform import by_target

FUSED = RankInfo(device_target="Ascend")  # the fused path (on CPU: the twins, installed by the caller)
ROWS = 8  # rows compared per sequence (first and last ROWS // 2)
EPS = 1e-6


@dataclass(frozen=True)
class Layout:
    """The per-rank shapes of one model layout: a packed row of ``ends`` (cumulative sequence ends)."""

    name: str
    ends: tuple[int, ...]
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int

    @property
    def tokens(self) -> int:
        return self.ends[-1]


def layouts(device: str) -> list[Layout]:
    """Qwen2.5-7B at TP 1 and 2, S = 4096 packed with three sequences, on Ascend; on CPU the same
    structure scaled down (the twins compute in fp32 on two cores)."""
    if by_target(device).accelerator:
        full = Layout("tp1", ends=(1024, 2560, 4096), hidden=3584, heads=28, kv_heads=4, head_dim=128, inter=18944,
                      vocab=152064)
    else:
        full = Layout("tp1", ends=(16, 40, 64), hidden=64, heads=4, kv_heads=2, head_dim=16, inter=128, vocab=96)
    return [replace(full, name=f"tp{tp}", heads=full.heads // tp, kv_heads=full.kv_heads // tp,
                    inter=full.inter // tp, vocab=full.vocab // tp) for tp in (1, 2)]


def _rand(rng: np.random.Generator, shape: tuple, dtype, scale: float = 1.0, base: float = 0.0):
    """(device tensor in ``dtype``, the same values in fp32 on the host)."""
    t = Tensor((base + scale * rng.standard_normal(shape)).astype(np.float32)).astype(dtype)
    return t, t.astype(ms.float32).asnumpy()


def _np(t) -> np.ndarray:
    return t.astype(ms.float32).asnumpy()


def sample_rows(ends: tuple[int, ...]) -> np.ndarray:
    """The first and last ``ROWS // 2`` token indices of each sequence."""
    rows = []
    for lo, hi in zip((0,) + ends[:-1], ends):
        rows += list(range(lo, min(hi, lo + ROWS // 2))) + list(range(max(lo, hi - ROWS // 2), hi))
    return np.unique(np.array(rows))


def positions(ends: tuple[int, ...]) -> np.ndarray:
    return np.concatenate([np.arange(hi - lo) for lo, hi in zip((0,) + ends[:-1], ends)])


def rope_tables(ends: tuple[int, ...], head_dim: int, theta: float = 1e6) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin ``[1, T, 1, D]`` (positions restart at each sequence) as the model builds them."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    f = positions(ends)[:, None] * inv
    emb = np.concatenate([f, f], -1)[None, :, None, :]
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def check_rms_norm(lay: Layout, dtype, rng):
    x, xn = _rand(rng, (1, lay.tokens, lay.hidden), dtype)
    w, wn = _rand(rng, (lay.hidden,), dtype, 0.1, 1.0)
    got = kernels.rms_norm(x, w, EPS, fused=True)
    ref = xn / np.sqrt((xn * xn).mean(-1, keepdims=True) + EPS) * wn
    return [_np(got)], [ref]


def _rotate(x: np.ndarray) -> np.ndarray:
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], -1)


def check_rope(lay: Layout, dtype, rng):
    x, xn = _rand(rng, (1, lay.tokens, lay.heads, lay.head_dim), dtype)
    cos, sin = rope_tables(lay.ends, lay.head_dim)
    cos_t, sin_t = Tensor(cos).astype(dtype), Tensor(sin).astype(dtype)
    got = kernels.rope(x, cos_t, sin_t, fused=True)
    c, s = _np(cos_t), _np(sin_t)
    return [_np(got)], [xn * c + _rotate(xn) * s]


def check_swiglu(lay: Layout, dtype, rng):
    g, gn = _rand(rng, (1, lay.tokens, lay.inter), dtype)
    u, un = _rand(rng, (1, lay.tokens, lay.inter), dtype)
    got = kernels.swiglu(g, u, fused=True)
    return [_np(got)], [gn / (1.0 + np.exp(-gn)) * un]


def _attention_ref(q, k, v, ends, rows, scale, dout=None):
    """fp32 packed causal attention at query ``rows`` (``[T, N, D]`` inputs, GQA); with ``dout``
    (nonzero only at ``rows``) also (dq, dk, dv) of ``sum(out * dout)``."""
    rep = q.shape[1] // k.shape[1]
    kk, vv = np.repeat(k, rep, 1), np.repeat(v, rep, 1)
    out = np.zeros((len(rows),) + q.shape[1:], np.float32)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(kk), np.zeros_like(vv)
    starts = np.searchsorted(np.array(ends), rows, side="right")
    for i, r in enumerate(rows):
        lo = 0 if starts[i] == 0 else ends[starts[i] - 1]
        ks, vs = kk[lo:r + 1], vv[lo:r + 1]  # [L, N, D]
        s = np.einsum("nd,lnd->nl", q[r], ks) * scale
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[i] = np.einsum("nl,lnd->nd", p, vs)
        if dout is not None:
            dp = np.einsum("nd,lnd->nl", dout[r], vs)
            ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
            dq[r] = np.einsum("nl,lnd->nd", ds, ks)
            dk[lo:r + 1] += np.einsum("nl,nd->lnd", ds, q[r])
            dv[lo:r + 1] += np.einsum("nl,nd->lnd", p, dout[r])
    fold = lambda g: g.reshape(g.shape[0], k.shape[1], rep, -1).sum(2)  # noqa: E731 - GQA: sum the group
    return out, dq, fold(dk), fold(dv)


def _qkv(lay: Layout, dtype, rng):
    shape = lambda n: (1, lay.tokens, n, lay.head_dim)  # noqa: E731 - a one-line shape
    return [_rand(rng, shape(n), dtype) for n in (lay.heads, lay.kv_heads, lay.kv_heads)]


def check_flash_forward(lay: Layout, dtype, rng):
    (q, qn), (k, kn), (v, vn) = _qkv(lay, dtype, rng)
    scale = lay.head_dim ** -0.5
    got = kernels.attention(q, k, v, lay.heads, lay.kv_heads, kernels.Packed(lay.ends), scale)
    rows = sample_rows(lay.ends)
    ref = _attention_ref(qn[0], kn[0], vn[0], lay.ends, rows, scale)[0]
    return [_np(got)[0][rows]], [ref]


def check_flash_backward(lay: Layout, dtype, rng):
    (q, qn), (k, kn), (v, vn) = _qkv(lay, dtype, rng)
    scale = lay.head_dim ** -0.5
    rows = sample_rows(lay.ends)
    dout = np.zeros((lay.tokens, lay.heads, lay.head_dim), np.float32)
    dout[rows] = rng.standard_normal((len(rows), lay.heads, lay.head_dim))
    dout_t = Tensor(dout[None]).astype(dtype)
    dout = _np(dout_t)[0]
    spec = kernels.Packed(lay.ends)

    def loss(q_, k_, v_):
        out = kernels.attention(q_, k_, v_, lay.heads, lay.kv_heads, spec, scale)
        return (out.astype(ms.float32) * dout_t.astype(ms.float32)).sum()

    grads = ms.grad(loss, grad_position=(0, 1, 2))(q, k, v)
    _, dq, dk, dv = _attention_ref(qn[0], kn[0], vn[0], lay.ends, rows, scale, dout)
    return [_np(g)[0] for g in grads], [dq, dk, dv]


def matmul_shapes(lay: Layout) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection the model runs per layer, and the LM head."""
    hd = lay.head_dim
    return {"qkv": (lay.hidden, (lay.heads + 2 * lay.kv_heads) * hd), "o_proj": (lay.heads * hd, lay.hidden),
            "gate_up": (lay.hidden, 2 * lay.inter), "down": (lay.inter, lay.hidden), "lm_head": (lay.hidden, lay.vocab)}


def check_matmul(name: str) -> Callable:
    """The projection ``name``: the full product on the device, sampled rows and columns compared."""

    def check(lay: Layout, dtype, rng):
        n_in, n_out = matmul_shapes(lay)[name]
        x, xn = _rand(rng, (lay.tokens, n_in), dtype)
        ms.set_seed(int(rng.integers(1 << 30)))  # the weight is drawn on the device, reproducibly
        w = (ops.randn((n_in, n_out)) * n_in ** -0.5).astype(dtype)
        got = ops.matmul(x, w)
        rows = sample_rows(lay.ends)
        cols = Tensor(np.unique(rng.integers(0, n_out, 64)).astype(np.int32))
        picked = got.index_select(0, Tensor(rows.astype(np.int32))).index_select(1, cols)  # only these leave the device
        return [_np(picked)], [xn[rows] @ _np(w.index_select(1, cols))]

    return check


def adamw_reference(w: np.ndarray, grads: list[np.ndarray], lr: float, betas, eps: float, wd: float) -> np.ndarray:
    """torch.optim.AdamW's weights after the steps of ``grads`` from zero moments."""
    m, v = np.zeros_like(w), np.zeros_like(w)
    for t, g in enumerate(grads, 1):
        w = w * (1 - lr * wd)
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        w = w - lr * (m / (1 - betas[0] ** t)) / (np.sqrt(v / (1 - betas[1] ** t)) + eps)
    return w


def check_optimizer(lay: Layout, dtype, rng):
    """Two steps of the project's AdamW (low-precision parameters, fp32 masters as the trainer sets them):
    the change of each master weight against torch AdamW's. No change at all is an error of 1."""
    from finetune.optim import AdamW
    from jobspec.config import TrainConfig

    cfg = TrainConfig(lr=1e-3, weight_decay=0.1, clip_grad=0.0)
    shapes = {"w": (lay.hidden, lay.hidden), "norm": (lay.hidden,)}
    params = [ms.Parameter(_rand(rng, s, dtype, 0.1)[0], name=n) for n, s in shapes.items()]
    before = [_np(p) for p in params]
    steps = [[_rand(rng, s, dtype)[0] for s in shapes.values()] for _ in range(2)]
    opt = AdamW(params, cfg, FUSED)
    for grads in steps:
        opt.step(grads, cfg.lr)
    state = opt.state_dict()
    got, ref = [], []
    for i, (p, w0) in enumerate(zip(params, before)):
        wd = cfg.weight_decay if len(p.shape) > 1 else 0.0
        after = state.get(f"master.{p.name}", _np(p))
        got.append(after - w0)
        ref.append(adamw_reference(w0, [_np(g[i]) for g in steps], cfg.lr, cfg.betas, cfg.eps, wd) - w0)
    return got, ref


TINY = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0, "max_position_embeddings": 64}


def tiny_models(dtype) -> tuple:
    """(the fused path in ``dtype``, the reference path in fp32) of :data:`TINY`, weights set by each check."""
    from finetune.model.decoder import DecoderLM, ModelConfig

    cfg = ModelConfig.from_dict(TINY)
    return (DecoderLM(cfg, FUSED, compute_dtype=dtype),
            DecoderLM(cfg, RankInfo(device_target="CPU"), compute_dtype=ms.float32))


def check_tiny_model(dtype, rng, models: tuple | None = None):
    """A two-layer Qwen2 (head_dim 16) on one packed row: loss and every gradient of the fused path in
    ``dtype`` against the model's reference path in fp32 (same device: the host has no model of its own).

    The gradients are compared as one array, each entry against the largest gradient of the whole model: a
    gradient that is nearly zero by design (``k_proj.bias``: softmax ignores a shift of every key) is not held
    to its own tiny scale, where bf16 rounding alone exceeded the tolerance (issue 30 item 6). ``models``:
    :func:`tiny_models` built once for several seeds (every weight is set here)."""
    fused, ref = models or tiny_models(dtype)
    for pf, pr in zip(fused.trainable_params(), ref.trainable_params()):
        base = 1.0 if pf.name.endswith("norm.weight") else 0.0
        value = (base + 0.1 * rng.standard_normal(pf.shape)).astype(np.float32)
        pf.set_data(Tensor(value).astype(dtype))
        pr.set_data(Tensor(pf.astype(ms.float32).asnumpy()))
    ends = (20, 44, 64)
    ids = rng.integers(0, TINY["vocab_size"], (1, 64)).astype(np.int32)
    seg = np.repeat(np.arange(1, 4), np.diff((0,) + ends))[None].astype(np.int32)
    batch = [Tensor(a) for a in (ids, ids, positions(ends)[None].astype(np.int32), seg)]
    out = []
    for model in (fused, ref):
        params = model.trainable_params()
        loss, grads = ms.value_and_grad(lambda *a, m=model: m(*a), None, params)(*batch)
        out.append([np.array([float(_np(loss))]), np.concatenate([_np(g).ravel() for g in grads])])
    return out[0], out[1]
