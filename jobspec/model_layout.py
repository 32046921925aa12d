"""The parameter table: every Hugging Face tensor with its full shape and
tensor-parallel split, for Qwen2 / Qwen2.5 (Coder, Math: ``model_type`` qwen2) and Qwen3 dense.

Pure Python (the launcher imports it). The model's TP slices, the memory estimate's local shapes,
the tiny model's tensors, preflight's parameter count, HF I/O and checkpoint resharding all derive
from :func:`param_table`; the TP divisibility rules live in :func:`tp_problems`.

Split rules (Megatron): q/k/v projections and gate/up split their output rows (axis 0), o/down their
input columns (axis 1); norms are replicated. KV heads are split when ``tp`` divides them, otherwise
(``tp`` a multiple of them) each rank holds one head, the same copy on ``tp / kv_heads`` ranks. The
embedding and an untied LM head split their vocabulary rows only when vocab-parallel. Qwen3's
per-head query/key norms (``q_norm``, ``k_norm``, size head_dim) are replicated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from jobspec.family import family_of


@dataclass(frozen=True)
class Dims:
    """The sizes and family flags of a Qwen2/Qwen3 config.json that fix the tensor shapes."""

    vocab: int
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool = True
    qk_norm: bool = False

    @classmethod
    def of(cls, config: dict[str, Any]) -> Dims:
        """From a Hugging Face config dict (or ``ModelConfig.to_dict()``)."""
        h, nh = config["hidden_size"], config["num_attention_heads"]
        fam = family_of(config)
        return cls(vocab=config["vocab_size"], hidden=h, inter=config["intermediate_size"],
                   layers=config["num_hidden_layers"], heads=nh,
                   kv_heads=config.get("num_key_value_heads") or nh, head_dim=config.get("head_dim") or h // nh,
                   tied=bool(config.get("tie_word_embeddings", False)),
                   qkv_bias=fam.qkv_bias, qk_norm=fam.qk_norm)


@dataclass(frozen=True)
class ParamSpec:
    """One Hugging Face tensor: full shape, TP split axis (None: replicated) and what it is split by."""

    name: str
    shape: tuple[int, ...]
    tp_axis: int | None = None
    split_by: str = ""  # "heads" | "kv_heads" | "inter" | "vocab" (vocab: only when vocab-parallel)


class TPSlice(NamedTuple):
    """This rank's piece of a full tensor: ``full[start:start+size]`` along ``axis``.

    ``owner`` is False for a replicated copy (KV heads when tp > num_key_value_heads) that a
    gather must not count twice.
    """

    axis: int
    start: int
    size: int
    owner: bool = True


def param_table(config: dict[str, Any]) -> list[ParamSpec]:
    """Every tensor of a Qwen2 / Qwen3 model, in Hugging Face module order."""
    d = Dims.of(config)
    h, q, kv = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim
    out = [ParamSpec("model.embed_tokens.weight", (d.vocab, h), 0, "vocab")]
    for n in range(d.layers):
        a, m = f"model.layers.{n}.self_attn.", f"model.layers.{n}.mlp."
        out.append(ParamSpec(f"model.layers.{n}.input_layernorm.weight", (h,)))
        for proj, rows, by in (("q_proj", q, "heads"), ("k_proj", kv, "kv_heads"), ("v_proj", kv, "kv_heads")):
            out.append(ParamSpec(a + proj + ".weight", (rows, h), 0, by))
            if d.qkv_bias:
                out.append(ParamSpec(a + proj + ".bias", (rows,), 0, by))
        out.append(ParamSpec(a + "o_proj.weight", (h, q), 1, "heads"))
        if d.qk_norm:
            out += [ParamSpec(a + "q_norm.weight", (d.head_dim,)), ParamSpec(a + "k_norm.weight", (d.head_dim,))]
        out += [ParamSpec(f"model.layers.{n}.post_attention_layernorm.weight", (h,)),
                ParamSpec(m + "gate_proj.weight", (d.inter, h), 0, "inter"),
                ParamSpec(m + "up_proj.weight", (d.inter, h), 0, "inter"),
                ParamSpec(m + "down_proj.weight", (h, d.inter), 1, "inter")]
    out.append(ParamSpec("model.norm.weight", (h,)))
    if not d.tied:
        out.append(ParamSpec("lm_head.weight", (d.vocab, h), 0, "vocab"))
    return out


def full_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> full (unsplit) shape."""
    return {p.name: p.shape for p in param_table(config)}


def param_count(config: dict[str, Any]) -> int:
    """Exact number of parameters (a tied embedding counted once)."""
    total = 0
    for p in param_table(config):
        n = 1
        for s in p.shape:
            n *= s
        total += n
    return total


def tp_problems(config: dict[str, Any], tp: int, vocab_parallel: bool = False) -> list[tuple[str, str]]:
    """(problem, fix) for each reason ``parallel.tp`` cannot split this model; empty when it can."""
    d = Dims.of(config)
    if tp < 1:
        return [(f"parallel.tp={tp} must be >= 1", "e.g. parallel.tp=1")]
    out = []
    if d.heads % tp:
        out.append(f"parallel.tp={tp} must divide num_attention_heads={d.heads}")
    if d.inter % tp:
        out.append(f"parallel.tp={tp} must divide intermediate_size={d.inter}")
    if d.heads % d.kv_heads:
        out.append(f"num_attention_heads={d.heads} is not a multiple of num_key_value_heads={d.kv_heads}")
    elif tp <= d.kv_heads and d.kv_heads % tp:
        out.append(f"parallel.tp={tp} must divide num_key_value_heads={d.kv_heads} (or be a multiple of it)")
    elif tp > d.kv_heads and tp % d.kv_heads:
        out.append(f"parallel.tp={tp} must be a multiple of num_key_value_heads={d.kv_heads} when larger")
    fits = [t for t in range(tp, 0, -1) if not (d.heads % t or d.inter % t or (d.kv_heads % t if t <= d.kv_heads
                                                                                 else t % d.kv_heads))]
    problems = [(msg, f"e.g. parallel.tp={fits[0] if fits else 1}") for msg in out]
    if vocab_parallel and d.vocab % tp:
        problems.append((f"parallel.tp={tp} must divide vocab_size={d.vocab} when vocab-parallel",
                         "parallel.vocab_parallel=false (embedding and LM head replicated), or a tp dividing it"))
    return problems


def check_tp(config: dict[str, Any], tp: int, vocab_parallel: bool = False) -> None:
    """Raise ValueError naming every :func:`tp_problems` at once, each with its fix."""
    problems = tp_problems(config, tp, vocab_parallel)
    if problems:
        raise ValueError("; ".join(f"{msg} ({fix})" for msg, fix in problems))


def local_kv_heads(config: dict[str, Any], tp: int) -> int:
    """KV heads held per TP rank: split when tp divides them, else one (a copy on tp/kv_heads ranks)."""
    nkv = Dims.of(config).kv_heads
    return nkv // tp if tp <= nkv else 1


def tp_slice(spec: ParamSpec, config: dict[str, Any], tp: int, tp_rank: int, vocab_parallel: bool) -> TPSlice | None:
    """This TP rank's slice of ``spec`` (None: the rank holds the whole tensor)."""
    if tp == 1 or spec.tp_axis is None or (spec.split_by == "vocab" and not vocab_parallel):
        return None
    d = Dims.of(config)
    if spec.split_by == "kv_heads" and tp > d.kv_heads:
        group = tp // d.kv_heads  # ranks sharing one kv head
        return TPSlice(spec.tp_axis, (tp_rank // group) * d.head_dim, d.head_dim, owner=tp_rank % group == 0)
    size = spec.shape[spec.tp_axis] // tp
    return TPSlice(spec.tp_axis, tp_rank * size, size)


def tp_layout(config: dict[str, Any], tp: int, tp_rank: int, vocab_parallel: bool = False) -> dict[str, TPSlice]:
    """Name -> this rank's slice, for every TP-split tensor (absent: held whole). Checks ``tp`` first."""
    check_tp(config, tp, vocab_parallel)
    out = {}
    for spec in param_table(config):
        part = tp_slice(spec, config, tp, tp_rank, vocab_parallel)
        if part is not None:
            out[spec.name] = part
    return out


def local_shapes(config: dict[str, Any], tp: int = 1, vocab_parallel: bool = False) -> dict[str, tuple[int, ...]]:
    """Name -> shape of one TP rank's tensor (the same on every rank of the group)."""
    layout = tp_layout(config, tp, 0, vocab_parallel)
    out = {}
    for spec in param_table(config):
        shape = list(spec.shape)
        if spec.name in layout:
            shape[layout[spec.name].axis] = layout[spec.name].size
        out[spec.name] = tuple(shape)
    return out
