"""Qwen2 / Qwen2.5 causal LM in MindSpore (PyNative), parameter names equal to Hugging Face's.

Parameters are fp32 masters; matmuls run in ``compute_dtype`` while norms, softmax and the loss
stay fp32. Fused Ascend kernels are used only when ``rank.device_target == "Ascend"``; the
reference implementation (the tested one) runs everywhere else. The caller sets the MindSpore
context (``ms.set_context(mode=ms.PYNATIVE_MODE, device_target=...)``) before building the model.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common import dtype as mstype
from mindspore.common.initializer import Normal, initializer

from finetune import kernels
from finetune.dist import RankInfo
from finetune.parallel.layers import ColumnParallelLinear, ReduceFromTP, RowParallelLinear
from finetune.tiny import hf_param_shapes

IGNORE_INDEX = -100
_MASKED = -1e9


@dataclass
class Qwen2Config:
    """The config.json fields the model uses; unknown Hugging Face keys are ignored."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    head_dim: int = 0  # 0: hidden_size // num_attention_heads

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "Qwen2Config":
        """Build from a Hugging Face config dict (rope_theta may sit in ``rope_parameters``)."""
        d = dict(d)
        d.setdefault("num_key_value_heads", d.get("num_attention_heads"))
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"{source}: rope type {rope.get('rope_type', rope.get('type'))!r} is not supported; "
                             "use a model with default RoPE (rope_scaling null)")
        if "rope_theta" not in d and "rope_theta" in rope:
            d["rope_theta"] = rope["rope_theta"]
        names = [f.name for f in dataclasses.fields(cls)]
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        missing = [k for k in required if d.get(k) is None]
        if missing:
            raise ValueError(f"{source}: missing {', '.join(missing)}; a Qwen2 config.json needs them "
                             "(e.g. \"hidden_size\": 3584)")
        cfg = cls(**{k: d[k] for k in names if d.get(k) is not None})
        if not cfg.head_dim:
            cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ValueError(f"{source}: num_attention_heads={cfg.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={cfg.num_key_value_heads}")
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "Qwen2Config":
        return cls.from_dict(json.loads(Path(path).read_text()), source=str(path))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class TPSlice(NamedTuple):
    """This rank's piece of a full Hugging Face tensor: ``full[start:start+size]`` along ``axis``.

    ``owner`` is False for a replicated copy (KV heads when tp > num_key_value_heads) that a
    gather must not count twice.
    """

    axis: int
    start: int
    size: int
    owner: bool = True


class RMSNorm(nn.Cell):
    """``weight * x / sqrt(mean(x^2) + eps)`` computed in fp32."""

    def __init__(self, hidden: int, eps: float, fused: bool):
        super().__init__()
        self.weight = Parameter(initializer("ones", (hidden,), ms.float32), name="weight")
        self.eps = eps
        self.fused = fused

    def construct(self, x):
        return kernels.rms_norm(x, self.weight, self.eps, self.fused)


class VocabRange(NamedTuple):
    """The token ids ``[start, start + size)`` whose rows this rank holds (all of them when not split)."""

    start: int
    size: int

    def local(self, ids):
        """``(ids - start)`` clipped to a valid row and an fp32 mask of the ids this rank holds."""
        local = ids - self.start
        inside = ops.logical_and(local >= 0, local < self.size)
        return ops.where(inside, local, ops.zeros_like(local)), inside.astype(ms.float32)


def vocab_range(vocab: int, rank: RankInfo, vocab_parallel: bool) -> VocabRange:
    """This rank's vocabulary rows: a contiguous ``vocab / tp`` slice when vocab-parallel over TP."""
    if not vocab_parallel or rank.tp == 1:
        return VocabRange(0, vocab)
    if vocab % rank.tp:
        raise ValueError(f"vocab_size={vocab} is not divisible by parallel.tp={rank.tp}; set "
                         "parallel.vocab_parallel=false (embedding and LM head replicated) or pick a tp dividing it")
    size = vocab // rank.tp
    return VocabRange(rank.tp_rank * size, size)


class Embedding(nn.Cell):
    """Token embedding: replicated, or vocab-parallel (each TP rank looks up its rows, then a TP sum)."""

    def __init__(self, vocab: int, hidden: int, compute_dtype, rank: RankInfo = RankInfo(),
                 vocab_parallel: bool = False):
        super().__init__()
        self.rows = vocab_range(vocab, rank, vocab_parallel)
        self.weight = Parameter(initializer(Normal(0.02), (self.rows.size, hidden), ms.float32), name="weight")
        self.dtype = compute_dtype
        self.split = self.rows.size != vocab
        self.reduce = ReduceFromTP(rank) if self.split else None

    def construct(self, ids):
        if not self.split:
            return ops.gather(self.weight, ids, 0).astype(self.dtype)
        local, inside = self.rows.local(ids)  # ids held elsewhere read row 0 and are zeroed
        x = ops.gather(self.weight, local, 0) * inside.expand_dims(-1).astype(self.weight.dtype)
        return self.reduce(x.astype(self.dtype))


class LMHead(nn.Cell):
    """Untied output projection ``[vocab, hidden]`` (``[vocab / tp, hidden]`` when vocab-parallel)."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.weight = Parameter(initializer(Normal(0.02), (vocab, hidden), ms.float32), name="weight")


class LMHeadCrossEntropy(nn.Cell):
    """``sum(-log_softmax(h @ w.T)[target])`` in fp32 with a hand-written backward.

    MindSpore's autodiff of log_softmax over a 150k vocabulary is several times slower on CPU than
    the closed form ``dlogits = softmax - onehot``; the backward recomputes the logits instead of
    keeping them, so only the forward's logits are ever alive. ``chunk_tokens`` > 0 computes both
    over chunks of that many tokens (``d weight`` summed in fp32), so the ``[tokens, vocab]`` fp32
    buffers shrink to ``[chunk, vocab]``; the sums are the same up to rounding order.

    Vocab-parallel (``rows`` a slice of the vocabulary, ``rank.tp > 1``): each TP rank holds the
    logits of its rows only. The row maxima, the sums of exponentials and the target logits are
    combined over the TP group, so every rank returns the whole loss; backward, each rank's
    ``d hidden`` covers its rows and is summed over the TP group.
    """

    def __init__(self, compute_dtype, rank: RankInfo = RankInfo(), rows: VocabRange | None = None,
                 chunk_tokens: int = 0):
        super().__init__()
        self.dtype = compute_dtype
        self.chunk = chunk_tokens  # > 0: logits of at most this many tokens alive at a time
        self.mm_bt = ops.MatMul(transpose_b=True)
        self.mm_at = ops.MatMul(transpose_a=True)
        self.split = rows is not None and rank.tp > 1  # rows: this rank's slice when vocab-parallel
        self.rows, self.tp, self.tp_rank = rows, rank.tp, rank.tp_rank
        self.tp_sum = ops.AllReduce(ops.ReduceOp.SUM, rank.tp_group) if self.split else None

    def _logits(self, h, w):
        return self.mm_bt(h.astype(self.dtype), w.astype(self.dtype)).astype(ms.float32)

    def _softmax_parts(self, logits, target):
        """Vocab-parallel: (row max over all ranks, sum of exp(logits - max) over all ranks,
        this rank's target logit or 0, local target column, 1.0 where this rank holds the target)."""
        local_max = ops.amax(logits, -1)
        slots = [local_max if i == self.tp_rank else ops.zeros_like(local_max) for i in range(self.tp)]
        row_max = ops.amax(self.tp_sum(ops.stack(slots)), 0)  # exact: one AllReduce of tp x tokens values
        col, inside = self.rows.local(target)
        picked = ops.gather_elements(logits, 1, col.reshape(-1, 1)).reshape(-1) * inside
        return row_max, ops.exp(logits - row_max.expand_dims(-1)).sum(-1), picked, col, inside

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        c = self.chunk if 0 < self.chunk < n else n
        return [(a, min(a + c, n)) for a in range(0, n, c)]

    def construct(self, h, w, target):
        parts = self._chunks(h.shape[0])
        if len(parts) == 1:
            return self._loss(h, w, target)
        total = self._loss(h[:parts[0][1]], w, target[:parts[0][1]])
        for a, b in parts[1:]:
            total = total + self._loss(h[a:b], w, target[a:b])
        return total

    def bprop(self, h, w, target, out, dout):
        parts = self._chunks(h.shape[0])
        if len(parts) == 1:
            dh, dw = self._grads(h, w, target, dout)
            return dh.astype(h.dtype), dw.astype(w.dtype), ops.zeros_like(target)
        dhs, dw = [], None
        for a, b in parts:
            dh_c, dw_c = self._grads(h[a:b], w, target[a:b], dout)
            dhs.append(dh_c)
            dw = dw_c.astype(ms.float32) if dw is None else dw + dw_c.astype(ms.float32)
        return ops.cat(dhs, 0).astype(h.dtype), dw.astype(w.dtype), ops.zeros_like(target)

    def _loss(self, h, w, target):
        """The loss sum of one chunk of tokens."""
        logits = self._logits(h, w)
        if not self.split:
            logp = ops.log_softmax(logits, -1)
            return -ops.gather_elements(logp, 1, target.reshape(-1, 1)).sum()
        row_max, sum_exp, picked, _, _ = self._softmax_parts(logits, target)
        total = self.tp_sum(ops.stack((sum_exp, picked)))  # [2, tokens]: sums over every rank's rows
        return (ops.log(total[0]) + row_max - total[1]).sum()

    def _grads(self, h, w, target, dout):
        """(d hidden, d weight) of one chunk of tokens, in the compute dtype."""
        logits = self._logits(h, w)
        if not self.split:
            p = ops.softmax(logits, -1)
            col, hit = target.reshape(-1, 1), 1.0
        else:
            row_max, sum_exp, _, col, inside = self._softmax_parts(logits, target)
            p = ops.exp(logits - row_max.expand_dims(-1)) / self.tp_sum(sum_exp).expand_dims(-1)
            col, hit = col.reshape(-1, 1), inside.reshape(-1, 1)
        p = ops.tensor_scatter_elements(p, col, ops.gather_elements(p, 1, col) - hit, 1).astype(self.dtype)
        dh = ops.matmul(p, w.astype(self.dtype)) * dout.astype(self.dtype)
        if self.split:  # every rank's rows contribute to d hidden
            dh = self.tp_sum(dh)
        dw = self.mm_at(p, (h.astype(ms.float32) * dout).astype(self.dtype))
        return dh, dw


class Attention(nn.Cell):
    """GQA self-attention with QKV bias, RoPE, causal + same-segment mask."""

    def __init__(self, cfg: Qwen2Config, rank: RankInfo, dtype, fused: bool):
        super().__init__()
        h, hd, nh, nkv, tp = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, rank.tp
        if nh % tp:
            raise ValueError(f"num_attention_heads={nh} is not divisible by parallel.tp={tp}; pick a tp dividing it")
        if tp > nkv and tp % nkv:
            raise ValueError(f"parallel.tp={tp} > num_key_value_heads={nkv} must be a multiple of it")
        self.heads, self.kv_heads, self.head_dim = nh // tp, max(nkv // tp, 1), hd
        self.scale = hd ** -0.5
        self.fused = fused
        kv_out = self.kv_heads * hd
        self.q_proj = ColumnParallelLinear(h, nh * hd, True, rank, dtype)
        self.k_proj = ColumnParallelLinear(h, nkv * hd, True, rank, dtype, local_out=kv_out, replicas=nkv)
        self.v_proj = ColumnParallelLinear(h, nkv * hd, True, rank, dtype, local_out=kv_out, replicas=nkv)
        self.o_proj = RowParallelLinear(nh * hd, h, False, rank, dtype)

    def construct(self, x, cos, sin, mask, cache=None):
        """``mask``: the reference mask or the fused attention's ``kernels.Packed`` spec.
        ``cache`` (generation): a list holding this layer's [keys, values] of the earlier
        positions (empty at first); the new ones are appended and attention covers all."""
        b, s, _ = x.shape
        q = self.q_proj(x).reshape(b, s, self.heads, self.head_dim)  # BSND
        k = self.k_proj(x).reshape(b, s, self.kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, s, self.kv_heads, self.head_dim)
        cos, sin = cos.astype(q.dtype), sin.astype(q.dtype)
        q, k = kernels.rope(q, cos, sin, self.fused), kernels.rope(k, cos, sin, self.fused)
        if cache is not None:
            if cache:
                k, v = ops.cat((cache[0], k), 1), ops.cat((cache[1], v), 1)
            cache[:] = [k, v]
        out = kernels.attention(q, k, v, self.heads, self.kv_heads, mask, self.scale)
        return self.o_proj(out.reshape(b, s, self.heads * self.head_dim))


class MLP(nn.Cell):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, no biases."""

    def __init__(self, cfg: Qwen2Config, rank: RankInfo, dtype, fused: bool):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = ColumnParallelLinear(h, i, False, rank, dtype)
        self.up_proj = ColumnParallelLinear(h, i, False, rank, dtype)
        self.down_proj = RowParallelLinear(i, h, False, rank, dtype)
        self.fused = fused

    def construct(self, x):
        return self.down_proj(kernels.swiglu(self.gate_proj(x), self.up_proj(x), self.fused))


class DecoderLayer(nn.Cell):
    """Pre-norm attention and MLP blocks with residuals."""

    def __init__(self, cfg: Qwen2Config, rank: RankInfo, dtype, fused: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused)
        self.self_attn = Attention(cfg, rank, dtype, fused)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused)
        self.mlp = MLP(cfg, rank, dtype, fused)

    def construct(self, x, cos, sin, mask, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nn.Cell):
    """Embedding, decoder layers and the final norm (``model.*`` in Hugging Face names)."""

    def __init__(self, cfg: Qwen2Config, rank: RankInfo, recompute: bool, dtype, fused: bool,
                 vocab_parallel: bool = False):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, rank, vocab_parallel)
        self.layers = nn.CellList([DecoderLayer(cfg, rank, dtype, fused) for _ in range(cfg.num_hidden_layers)])
        if recompute:
            for layer in self.layers:
                layer.recompute()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused)
        hd = cfg.head_dim
        attn = self.layers[0].self_attn if cfg.num_hidden_layers else None
        self.fused_attn = attn is not None and fused and kernels.flash_fits(dtype, hd, attn.heads, attn.kv_heads)
        inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
        self.inv_freq = Tensor(inv_freq.astype(np.float32))

    def construct(self, input_ids, position_ids, segment_ids, caches=None, past: int = 0):
        """Final hidden states. ``caches`` (generation, one segment per row): one list per layer
        with the keys/values of the ``past`` earlier positions, extended in place."""
        freqs = position_ids.astype(ms.float32).expand_dims(-1) * self.inv_freq  # [b, s, hd/2]
        emb = ops.cat((freqs, freqs), -1).expand_dims(2)  # [b, s, 1, hd]
        cos, sin = ops.cos(emb), ops.sin(emb)
        mask = self._mask(segment_ids, past, caches is not None)
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask) if caches is None else layer(x, cos, sin, mask, caches[i])
        return self.norm(x)

    def _mask(self, segment_ids, past: int, cached: bool):
        """The fused attention's spec of the sequences (same-segment causal; a prompt with an empty
        cache is one sequence per row), else the reference ``[b, 1, s, past + s]`` fp32 mask."""
        spec = kernels.packed(segment_ids.asnumpy()) if self.fused_attn and past == 0 else None
        if spec is not None:
            return spec
        s = segment_ids.shape[1]
        if not cached:
            causal = Tensor(np.tril(np.ones((s, s), np.bool_)))
            allowed = ops.logical_and(segment_ids.expand_dims(2) == segment_ids.expand_dims(1), causal)
        else:  # query i (position past + i) sees keys 0 .. past + i
            allowed = Tensor(np.tril(np.ones((s, past + s), np.bool_), past)).expand_dims(0)
        return (1.0 - allowed.astype(ms.float32)).expand_dims(1) * _MASKED


class Qwen2ForCausalLM(nn.Cell):
    """Qwen2 causal LM; ``model(input_ids, labels, position_ids, segment_ids) -> loss_sum``.

    ``vocab_parallel`` (with ``rank.tp > 1``): the embedding and the LM head hold ``vocab / tp``
    rows per TP rank and the loss is the parallel cross-entropy; otherwise both are replicated.
    """

    def __init__(self, cfg: Qwen2Config, rank: RankInfo = RankInfo(), recompute: bool = False,
                 compute_dtype=mstype.float32, vocab_parallel: bool = False, loss_chunk_tokens: int = 0):
        super().__init__()
        self.config = cfg
        self.rank = rank
        self.compute_dtype = compute_dtype
        self.vocab_parallel = vocab_parallel
        self.vocab_rows = vocab_range(cfg.vocab_size, rank, vocab_parallel)
        split = self.vocab_rows.size != cfg.vocab_size
        fused = rank.device_target == "Ascend"
        self.model = Qwen2Model(cfg, rank, recompute, compute_dtype, fused, vocab_parallel)
        self.lm_head = None if cfg.tie_word_embeddings else LMHead(self.vocab_rows.size, cfg.hidden_size)
        self.loss_fn = LMHeadCrossEntropy(compute_dtype, rank, self.vocab_rows if split else None,
                                          loss_chunk_tokens)
        self.tp_sum = ops.AllReduce(ops.ReduceOp.SUM, rank.tp_group) if split else None
        self.tp_layout = self._tp_layout()
        for name, p in self.hf_state().items():  # for the TP-aware grad norm (finetune/parallel/grads.py)
            if name in self.tp_layout:
                p.tp_axis, p.tp_owner = self.tp_layout[name].axis, self.tp_layout[name].owner

    # ------------------------------------------------------------------ names and TP layout
    def hf_state(self) -> dict[str, Parameter]:
        """Hugging Face tensor name -> this rank's Parameter (names are identical)."""
        return {p.name: p for p in self.get_parameters()}

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Full (unsplit) Hugging Face shape of every tensor, from the config."""
        return dict(hf_param_shapes(self.config.to_dict()))

    @property
    def tp_split(self) -> dict[str, int]:
        """Split axis of every TP-split parameter (absent: replicated)."""
        return {n: s.axis for n, s in self.tp_layout.items()}

    def _tp_layout(self) -> dict[str, TPSlice]:
        tp, r, cfg = self.rank.tp, self.rank.tp_rank, self.config
        if tp == 1:
            return {}
        out = {}
        rows = vocab_range(cfg.vocab_size, self.rank, self.vocab_parallel)
        if rows.size != cfg.vocab_size:  # vocab-parallel embedding / LM head
            out["model.embed_tokens.weight"] = TPSlice(0, rows.start, rows.size)
            if not cfg.tie_word_embeddings:
                out["lm_head.weight"] = TPSlice(0, rows.start, rows.size)
        hd, nkv = cfg.head_dim, cfg.num_key_value_heads
        q = cfg.num_attention_heads // tp * hd
        i = cfg.intermediate_size // tp
        if tp <= nkv:
            kv = TPSlice(0, r * (nkv // tp) * hd, (nkv // tp) * hd)
        else:
            group = tp // nkv  # ranks sharing one kv head
            kv = TPSlice(0, (r // group) * hd, hd, owner=r % group == 0)
        for n in range(cfg.num_hidden_layers):
            a, m = f"model.layers.{n}.self_attn.", f"model.layers.{n}.mlp."
            out.update({a + "q_proj.weight": TPSlice(0, r * q, q), a + "q_proj.bias": TPSlice(0, r * q, q),
                        a + "k_proj.weight": kv, a + "k_proj.bias": kv, a + "v_proj.weight": kv,
                        a + "v_proj.bias": kv, a + "o_proj.weight": TPSlice(1, r * q, q),
                        m + "gate_proj.weight": TPSlice(0, r * i, i), m + "up_proj.weight": TPSlice(0, r * i, i),
                        m + "down_proj.weight": TPSlice(1, r * i, i)})
        return out

    # ------------------------------------------------------------------ forward
    def _head_weight(self):
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def _project(self, h):
        """Hidden states ``[..., hidden]`` -> fp32 logits over the whole vocabulary (matmul in compute
        dtype; vocab-parallel: each rank's columns placed in zeros and summed over the TP group)."""
        lead = h.shape[:-1]
        logits = self.loss_fn._logits(h.reshape(-1, h.shape[-1]), self._head_weight())
        if self.tp_sum is not None:
            rows, vocab = self.vocab_rows, self.config.vocab_size
            parts = [ops.zeros((logits.shape[0], rows.start), ms.float32), logits,
                     ops.zeros((logits.shape[0], vocab - rows.start - rows.size), ms.float32)]
            logits = self.tp_sum(ops.cat([x for x in parts if x.shape[1]], -1))
        return logits.reshape(*lead, -1)

    def construct(self, input_ids, labels, position_ids, segment_ids):
        """Sum of token cross-entropies where the shifted label != -100 (fp32 scalar)."""
        h = self.model(input_ids, position_ids, segment_ids)
        hidden = h.shape[-1]
        h = h[:, :-1].reshape(-1, hidden)
        target = labels[:, 1:].reshape(-1)
        idx = ops.nonzero(target != IGNORE_INDEX).reshape(-1)
        if idx.shape[0] == 0:  # no label in the batch: zero loss, zero gradients (empty kernels fail on CPU)
            return h.sum().astype(ms.float32) * 0.0 + 0.0  # + 0.0 turns -0.0 into 0.0
        h = ops.gather(h, idx, 0)
        target = ops.gather(target, idx, 0).astype(ms.int32)
        return self.loss_fn(h, self._head_weight(), target)

    def _hidden(self, input_ids, position_ids=None, segment_ids=None):
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = Tensor(np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy())
        if segment_ids is None:
            segment_ids = ops.ones((b, s), ms.int32)
        return self.model(input_ids, position_ids, segment_ids)

    def logits(self, input_ids, position_ids=None, segment_ids=None):
        """``[b, s, vocab]`` fp32 logits; default positions 0..s-1 and one segment per row."""
        return self._project(self._hidden(input_ids, position_ids, segment_ids))

    def last_logits(self, input_ids, caches: list | None = None):
        """``[b, vocab]`` fp32 logits of the last position only (for generation). With ``caches``
        (``new_caches()``, then kept between calls) ``input_ids`` are only the positions after
        the cached ones, whose keys and values are reused."""
        if caches is None:
            return self._project(self._hidden(input_ids)[:, -1])
        b, s = input_ids.shape
        past = int(caches[0][0].shape[1]) if caches[0] else 0  # keys are BSND
        pos = Tensor(np.broadcast_to(np.arange(past, past + s, dtype=np.int32), (b, s)).copy())
        h = self.model(input_ids, pos, ops.ones((b, s), ms.int32), caches, past)
        return self._project(h[:, -1])

    def new_caches(self) -> list:
        """Empty key/value caches for ``last_logits``."""
        return [[] for _ in self.model.layers]
