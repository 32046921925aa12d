"""Qwen2 / Qwen2.5 and Qwen3 dense causal LMs in MindSpore (PyNative), parameter names equal to
Hugging Face's. The family (``jobspec.family.FAMILIES``) fixes the attention: Qwen2 has
q/k/v biases, Qwen3 none and an RMSNorm over each query and key head before RoPE.

Parameters are fp32 masters; matmuls run in ``compute_dtype`` while norms, softmax and the loss
stay fp32. Fused Ascend kernels are used only where ``rank.platform.fused_kernels``; the
reference implementation (the tested one) runs everywhere else. The caller sets the MindSpore
context (``ms.set_context(mode=ms.PYNATIVE_MODE)`` and ``mindspore.set_device``) before building the model.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, mint, nn, ops
from mindspore.common import dtype as mstype
from mindspore.common.initializer import initializer

from finetune.dist import RankInfo
from finetune.model import kernels
from finetune.parallel.layers import ColumnParallelLinear, CopyToTP, RowParallelLinear
from finetune.parallel.vocab import Embedding, LMHead, LMHeadCrossEntropy, TiedGradient, VocabRange
from jobspec.data.template import IGNORE
from jobspec.family import family_of
from jobspec.model_layout import Dims, TPSlice, full_shapes, local_kv_heads, tp_layout

_MASKED = -1e9


def compute_dtype(precision: str) -> ms.Type:
    """The dtype of weights and matmuls for a resolved ``train.precision`` (fp32, bf16 or fp16)."""
    return {"fp32": ms.float32, "bf16": ms.bfloat16, "fp16": ms.float16}[precision]


@dataclass
class ModelConfig:
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
    model_type: str = "qwen2"  # a key of jobspec.family.FAMILIES

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> ModelConfig:
        """Build from a Hugging Face config dict (rope_theta may sit in ``rope_parameters``); a
        family other than Qwen2/Qwen3 dense is refused (``family_of``), and a RoPE kind other than the family's."""
        d = dict(d)
        family = family_of(d)
        d["model_type"] = family.model_type
        d.setdefault("num_key_value_heads", d.get("num_attention_heads"))
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != family.rope:
            raise ValueError(f"{source}: rope type {rope.get('rope_type', rope.get('type'))!r} is not supported; "
                             f"use a model with {family.rope} RoPE (rope_scaling null)")
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
        return cfg

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class RMSNorm(nn.Cell):
    """``weight * x / sqrt(mean(x^2) + eps)`` computed in fp32."""

    def __init__(self, hidden: int, eps: float, fused: bool, tp_sum: CopyToTP | None = None):
        """``tp_sum``: sum the weight's gradient over the TP group (a norm over heads split by TP)."""
        super().__init__()
        self.weight = Parameter(initializer("ones", (hidden,), ms.float32), name="weight")
        self.eps = eps
        self.fused = fused
        self.tp_sum = tp_sum

    def construct(self, x):
        w = self.tp_sum(self.weight) if self.tp_sum is not None else self.weight
        return kernels.rms_norm(x, w, self.eps, self.fused)


class Attention(nn.Cell):
    """GQA self-attention (Qwen2: QKV bias; Qwen3: per-head q/k RMSNorm), RoPE, causal + same-segment
    mask. Each TP rank normalizes only its heads, so the q/k norm weights' gradients are summed over TP."""

    def __init__(self, cfg: ModelConfig, rank: RankInfo, dtype, fused: bool):
        super().__init__()
        h, hd, nh, nkv, tp = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, rank.tp
        self.heads, self.kv_heads, self.head_dim = nh // tp, local_kv_heads(cfg.to_dict(), tp), hd
        self.scale = hd ** -0.5
        self.fused = fused
        kv_out = self.kv_heads * hd
        dims = Dims.of(cfg.to_dict())
        bias = dims.qkv_bias
        self.q_proj = ColumnParallelLinear(h, nh * hd, bias, rank, dtype)
        self.k_proj = ColumnParallelLinear(h, nkv * hd, bias, rank, dtype, local_out=kv_out, replicas=nkv)
        self.v_proj = ColumnParallelLinear(h, nkv * hd, bias, rank, dtype, local_out=kv_out, replicas=nkv)
        self.o_proj = RowParallelLinear(nh * hd, h, False, rank, dtype)
        self.q_norm = self.k_norm = None
        if dims.qk_norm:
            tp_sum = CopyToTP(rank) if tp > 1 else None
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, fused, tp_sum)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, fused, tp_sum)

    def construct(self, x, cos, sin, mask, cache=None):
        """``mask``: the reference mask or the fused attention's ``kernels.Packed`` spec.
        ``cache`` (generation): a list holding this layer's [keys, values] of the earlier
        positions (empty at first); the new ones are appended and attention covers all."""
        b, s, _ = x.shape
        q = self.q_proj(x).reshape(b, s, self.heads, self.head_dim)  # BSND
        k = self.k_proj(x).reshape(b, s, self.kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, s, self.kv_heads, self.head_dim)
        if self.q_norm is not None:  # over head_dim of [b, s, heads, head_dim]
            q, k = self.q_norm(q), self.k_norm(k)
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

    def __init__(self, cfg: ModelConfig, rank: RankInfo, dtype, fused: bool):
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

    def __init__(self, cfg: ModelConfig, rank: RankInfo, dtype, fused: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused)
        self.self_attn = Attention(cfg, rank, dtype, fused)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused)
        self.mlp = MLP(cfg, rank, dtype, fused)

    def construct(self, x, cos, sin, mask, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Cell):
    """Embedding, decoder layers and the final norm (``model.*`` in Hugging Face names)."""

    def __init__(self, cfg: ModelConfig, rank: RankInfo, recompute: bool, dtype, fused: bool,
                 vocab_rows: VocabRange | None = None):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, rank, vocab_rows)
        self.layers = nn.CellList([DecoderLayer(cfg, rank, dtype, fused) for _ in range(cfg.num_hidden_layers)])
        if recompute:
            self.recompute_layers()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused)
        hd = cfg.head_dim
        attn = self.layers[0].self_attn if cfg.num_hidden_layers else None
        self.fused_attn = attn is not None and fused and kernels.flash_fits(dtype, hd, attn.heads, attn.kv_heads)
        self.graphs: list = []  # compile_layers()
        inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
        self.inv_freq = Tensor(inv_freq.astype(np.float32))

    def recompute_layers(self) -> None:
        """Each decoder layer recomputed in the backward. MindSpore's recompute cell differentiates the
        parameters trainable when this is called: call it after freezing or adding any (LoRA)."""
        for layer in self.layers:
            layer.recompute()

    def construct(self, input_ids, position_ids, segment_ids, caches=None, past: int = 0, keys=None):
        """Final hidden states. ``caches`` (generation, one segment per row): one list per layer
        with the keys/values of the ``past`` earlier positions, extended in place; ``keys``
        (bool ``[b, past + s]``, optional): which of them are tokens, not padding."""
        freqs = position_ids.astype(ms.float32).unsqueeze(-1) * self.inv_freq  # [b, s, hd/2]
        emb = ops.cat((freqs, freqs), -1).unsqueeze(2)  # [b, s, 1, hd]
        cos, sin = ops.cos(emb), ops.sin(emb)
        mask = self._mask(segment_ids, past, caches is not None, keys)
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            if caches is not None:
                x = layer(x, cos, sin, mask, caches[i])
            else:
                x = self.graphs[i](x, cos, sin, mask) if self.graphs else layer(x, cos, sin, mask)
        return self.norm(x)

    def compile_layers(self) -> None:
        """Run each decoder layer of the reference path as one graph (``mindspore.jit``): forward +
        backward ~5x faster than op by op in PyNative on CPU (docs/speed.md), but compiled again for
        each new input shape. Not for the fused path (its attention spec is host data) or recompute.
        Before LoRA's adapters are attached: ``apply_lora`` then draws their dropout masks ahead."""
        late = [name for name, cell in self.cells_and_names()
                if getattr(cell, "pre_draw", True) is False and getattr(cell, "dropout", 0) > 0]
        if late:
            raise ValueError(f"compile_layers after LoRA adapters with dropout ({late[0]}, ...): a graph would "
                             "freeze their first dropout mask; compile the layers first, then apply_lora "
                             "(as finetune.run.training.build_model does)")
        self.graphs = [ms.jit(layer.construct) for layer in self.layers]

    def _mask(self, segment_ids, past: int, cached: bool, keys=None):
        """The fused attention's spec of the sequences (same-segment causal; a prompt with an empty
        cache is one sequence per row), else the reference ``[b, 1, s, past + s]`` fp32 mask
        (``keys``: bool ``[b, past + s]``, False at left padding, which no query sees)."""
        spec = None
        if self.fused_attn and past == 0 and keys is None:  # the host array when the loop passed it (no device read)
            host = getattr(segment_ids, "host", None)
            spec = kernels.packed(host if host is not None else segment_ids.asnumpy())
        if spec is not None:
            return spec
        s = segment_ids.shape[1]
        if not cached:
            causal = Tensor(np.tril(np.ones((s, s), np.bool_)))
            allowed = ops.logical_and(segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1), causal)
        else:  # query i (position past + i) sees keys 0 .. past + i
            allowed = Tensor(np.tril(np.ones((s, past + s), np.bool_), past)).unsqueeze(0)
            if keys is not None:
                allowed = ops.logical_and(allowed, keys.unsqueeze(1))
        return (1.0 - allowed.astype(ms.float32)).unsqueeze(1) * _MASKED


def labelled_rows(labels: Tensor) -> np.ndarray:
    """int32 indices of the flattened ``[b, s - 1]`` positions whose next-token label counts (!= -100),
    from the labels' host array (``.host``, set by ``trainer.batch_tensors``) so that no micro-batch waits
    for the device; a Tensor without one is read once."""
    host = getattr(labels, "host", None)
    host = labels.asnumpy() if host is None else host
    return np.flatnonzero(host[:, 1:].reshape(-1) != IGNORE).astype(np.int32)


class DecoderLM(nn.Cell):
    """Qwen2 / Qwen3 causal LM; ``model(input_ids, labels, position_ids, segment_ids) -> loss_sum``.

    ``vocab_parallel`` (with ``rank.tp > 1``): the embedding and the LM head hold ``vocab / tp``
    rows per TP rank and the loss is the parallel cross-entropy; otherwise both are replicated.
    """

    def __init__(self, cfg: ModelConfig, rank: RankInfo = RankInfo(), recompute: bool = False,
                 compute_dtype=mstype.float32, vocab_parallel: bool = False, loss_chunk_tokens: int = 0):
        super().__init__()
        self.config = cfg
        self.rank = rank
        self.compute_dtype = compute_dtype
        self.vocab_parallel = vocab_parallel
        self.tp_layout: dict[str, TPSlice] = tp_layout(cfg.to_dict(), rank.tp, rank.tp_rank, vocab_parallel)
        rows = self.tp_layout.get("model.embed_tokens.weight")  # split only when vocab-parallel
        self.vocab_rows = VocabRange(rows.start, rows.size) if rows else VocabRange(0, cfg.vocab_size)
        split = rows is not None
        fused = rank.platform.fused_kernels
        self.model = DecoderModel(cfg, rank, recompute, compute_dtype, fused, self.vocab_rows)
        self.lm_head = None if cfg.tie_word_embeddings else LMHead(self.vocab_rows.size, cfg.hidden_size)
        self.loss_fn = LMHeadCrossEntropy(compute_dtype, rank, self.vocab_rows if split else None,
                                          loss_chunk_tokens)
        if cfg.tie_word_embeddings and rank.platform.host_memory and not split:  # one d weight buffer, not three
            self.loss_fn.tied = TiedGradient()
            self.model.embed_tokens.tie(self.loss_fn.tied)
        elif rank.platform.host_memory and not split and compute_dtype in (ms.float32, ms.float16):
            # no dense accumulator: the rows (summed in the compute dtype, as autodiff sums them; numpy has no bf16)
            self.model.embed_tokens.by_rows()
        self.tp_sum = ops.AllReduce(ops.ReduceOp.SUM, rank.tp_group) if split else None
        shapes = self.hf_shapes()
        for name, p in self.hf_state().items():  # for resharding checkpoints (finetune/io/reshard.py) and
            p.hf_shape, p.tp_slice = shapes[name], self.tp_layout.get(name)  # the TP-aware grad norm (grads.py)
            if p.tp_slice is not None:
                p.tp_axis, p.tp_owner = p.tp_slice.axis, p.tp_slice.owner

    # ------------------------------------------------------------------ names and TP layout
    def hf_state(self) -> dict[str, Parameter]:
        """Hugging Face tensor name -> this rank's Parameter (names are identical; LoRA adapters excluded)."""
        shapes = self.hf_shapes()
        return {p.name: p for p in self.get_parameters() if p.name in shapes}

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Full (unsplit) Hugging Face shape of every tensor, from the config."""
        return full_shapes(self.config.to_dict())

    def cast_params(self, dtype) -> None:
        """Hold the weights in ``dtype`` (the optimizer keeps the fp32 masters).

        A tied embedding stays fp32: its two gradient paths (lookup and LM head) must agree in
        dtype. Only small models tie embeddings (Qwen2.5 up to 3B, Qwen3 up to 4B).
        """
        if dtype == ms.float32:
            return
        for p in self.trainable_params():
            if not (self.config.tie_word_embeddings and p.name == "model.embed_tokens.weight"):
                p.set_dtype(dtype)  # set_data(p.astype(...)) would keep the Parameter's fp32 dtype

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
            parts = [ops.zeros((logits.shape[0], rows.start), dtype=ms.float32), logits,
                     ops.zeros((logits.shape[0], vocab - rows.start - rows.size), dtype=ms.float32)]
            logits = self.tp_sum(ops.cat([x for x in parts if x.shape[1]], -1))
        return logits.reshape(*lead, -1)

    def construct(self, input_ids, labels, position_ids, segment_ids):
        """Sum of token cross-entropies where the shifted label != -100 (fp32 scalar)."""
        h = self.model(input_ids, position_ids, segment_ids)
        hidden = h.shape[-1]
        h = h[:, :-1].reshape(-1, hidden)
        rows = labelled_rows(labels)
        if rows.size == 0:  # no label in the batch: zero loss, zero gradients (empty kernels fail on CPU)
            return h.sum().astype(ms.float32) * 0.0 + 0.0  # + 0.0 turns -0.0 into 0.0
        idx = Tensor(rows)  # a host-to-device copy: the device is never waited for
        target = labels[:, 1:].reshape(-1).index_select(0, idx).astype(ms.int32)
        w = self._head_weight()  # tied (TiedGradient): its gradient comes from the lookup's backward only
        return self.loss_fn(h.index_select(0, idx), w if self.loss_fn.tied is None else ops.stop_gradient(w), target)

    def _hidden(self, input_ids, position_ids=None, segment_ids=None):
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = Tensor(np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy())
        if segment_ids is None:
            segment_ids = mint.ones((b, s), dtype=ms.int32)
        return self.model(input_ids, position_ids, segment_ids)

    def logits(self, input_ids, position_ids=None, segment_ids=None):
        """``[b, s, vocab]`` fp32 logits; default positions 0..s-1 and one segment per row."""
        return self._project(self._hidden(input_ids, position_ids, segment_ids))

    def last_logits(self, input_ids, caches: list | None = None, pad: np.ndarray | None = None,
                    keys: np.ndarray | None = None):
        """``[b, vocab]`` fp32 logits of the last position only (for generation). With ``caches``
        (``new_caches()``, then kept between calls) ``input_ids`` are only the positions after
        the cached ones, whose keys and values are reused.

        Batched prompts of different lengths are left-padded: ``pad`` ``[b]`` pad tokens per row
        (positions start after them) and ``keys`` bool ``[b, past + s]`` the non-pad tokens so far.
        """
        if caches is None:
            return self._project(self._hidden(input_ids)[:, -1])
        b, s = input_ids.shape
        past = int(caches[0][0].shape[1]) if caches[0] else 0  # keys are BSND
        pos = np.broadcast_to(np.arange(past, past + s, dtype=np.int32), (b, s))
        if pad is not None:
            pos = np.maximum(pos - np.asarray(pad, np.int32)[:, None], 0)
        h = self.model(input_ids, Tensor(pos.copy()), mint.ones((b, s), dtype=ms.int32), caches, past,
                       None if keys is None else Tensor(np.asarray(keys, np.bool_)))
        return self._project(h[:, -1])

    def new_caches(self) -> list:
        """Empty key/value caches for ``last_logits``."""
        return [[] for _ in self.model.layers]
