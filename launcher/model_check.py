"""A model directory's weights against its config.json, from the safetensors headers only (no tensor data):
every tensor the layout table (jobspec/qwen2_layout.py) expects, in its shape. Preflight's model row."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from jobspec.hf_files import read_header
from jobspec.qwen2_layout import Dims, family_of, full_shapes

FIX = ("config.json and the weights are of different models: use the config.json that came with these weights "
       "(model_type, head_dim, tie_word_embeddings), or re-download the model")


def header_shapes(files: list[Path]) -> dict[str, tuple[tuple[int, ...], Path]]:
    """Tensor name -> (shape, file) over the weight files' headers."""
    return {name: (tuple(t["shape"]), f) for f in files for name, t in read_header(f)[0].items()}


def weight_problems(d: Path, cfg: dict[str, Any], shards: list[str]) -> list[tuple[str, str]]:
    """(detail, fix) rows: each expected tensor missing from the weights or of another shape (the first five,
    then a count), then what the weights plainly are where config.json says otherwise; the fix on the last."""
    try:
        expected = full_shapes(cfg)
    except (KeyError, TypeError, ZeroDivisionError) as e:
        return [(f"{d / 'config.json'}: no usable {e} (the tensor shapes follow from it)", FIX)]
    found = header_shapes([d / s for s in shards])
    out = []
    for name, shape in expected.items():
        if name not in found:
            out.append(f"{d}: tensor {name} (shape {list(shape)}) is missing from the weights")
        elif found[name][0] != shape:
            out.append(f"{found[name][1]}: tensor {name} has shape {list(found[name][0])}, config.json gives "
                       f"{list(shape)}")
    if not out:
        return []
    rows = out[:5] + ([f"... and {len(out) - 5} more"] if len(out) > 5 else []) + _hints(cfg, found)
    return [(row, FIX if i == len(rows) - 1 else "") for i, row in enumerate(rows)]


def _hints(cfg: dict[str, Any], found: dict[str, tuple[tuple[int, ...], Path]]) -> list[str]:
    """What the weights say they are, where config.json says otherwise."""
    d, fam, out = Dims.of(cfg), family_of(cfg), []
    q = found.get("model.layers.0.self_attn.q_proj.weight")
    if q and q[0][0] != d.heads * d.head_dim and not q[0][0] % d.heads:
        given = f"head_dim {cfg['head_dim']}" if "head_dim" in cfg else \
            f"no head_dim (so hidden_size / num_attention_heads = {d.head_dim})"
        out.append(f"the weights' q_proj has head_dim {q[0][0] // d.heads} ({q[0][0]} rows / {d.heads} heads); "
                   f"config.json has {given}")
    biases = "model.layers.0.self_attn.q_proj.bias" in found
    norms = "model.layers.0.self_attn.q_norm.weight" in found
    if fam.qk_norm and biases and not norms:
        out.append(f"the weights have q/k/v biases and no q_norm / k_norm: Qwen2 / Qwen2.5 weights, but config.json "
                   f"says model_type {fam.model_type}")
    elif not fam.qk_norm and norms and not biases:
        out.append(f"the weights have q_norm / k_norm and no q/k/v biases: Qwen3 weights, but config.json says "
                   f"model_type {fam.model_type}")
    if d.tied and "lm_head.weight" in found:
        out.append("the weights hold lm_head.weight but config.json says tie_word_embeddings true")
    return out
