"""A model directory's weights against its config.json, and a LoRA adapter against its base, from the
safetensors headers only (no tensor data): every tensor the layout table (jobspec/model_layout.py) expects,
in its shape. Preflight's model row; ``generate --adapter``."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from jobspec.family import family_of
from jobspec.hf_files import read_header
from jobspec.model_layout import Dims, full_shapes

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


PEFT_PREFIX = "base_model.model."  # peft's tensor names (finetune/io/lora_io.py writes them)


def adapter_problems(adapter: Path, base: Path) -> list[str]:
    """A peft adapter directory against the base model it is to be applied to, from adapter_config.json and
    the adapter's safetensors header: each tensor whose base weight is missing or of another shape."""
    try:
        peft = json.loads((adapter / "adapter_config.json").read_text())
        expected = full_shapes(json.loads((base / "config.json").read_text()))
        found = header_shapes([adapter / "adapter_model.safetensors"])
    except (OSError, ValueError, KeyError, TypeError) as e:  # generate itself names a missing file
        return [] if isinstance(e, FileNotFoundError) else [f"{adapter} or {base}: unreadable ({e})"]
    trained_on = f" (adapter_config.json: trained on {peft.get('base_model_name_or_path')})"
    out = []
    for name, (shape, _) in sorted(found.items()):
        module, lora, kind = name.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        weight = f"{module}.weight" if lora else name.removeprefix(PEFT_PREFIX)
        need = expected.get(weight)
        if not lora and need is None:  # a saved module under a name of peft's own: generate reads it
            continue
        # lora_A is (r, in features), lora_B (out features, r); a saved module has the base's shape
        fits = need is not None and (shape[1] == need[1] if kind == "A.weight" else shape[0] == need[0]
                                     if kind == "B.weight" else shape == need)
        if not fits:
            has = f"{weight} of shape {list(need)}" if need else f"no {weight}"
            out.append(f"{adapter}: {name} has shape {list(shape)}, but the base {base} has {has}")
    if out:
        rows = out[:3] + ([f"... and {len(out) - 3} more"] if len(out) > 3 else [])
        return [*rows, f"this adapter belongs to another model{trained_on}; give --model-dir that model"]
    return []


def adapter_refused(options: list[str], base: str) -> bool:
    """``generate --adapter DIR`` whose tensors do not fit the base (``--model-dir``, else ``base``): said, True."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--adapter")
    ap.add_argument("--model-dir")
    given = ap.parse_known_args(options)[0]
    problems = adapter_problems(Path(given.adapter), Path(given.model_dir or base)) if given.adapter else []
    for p in problems:
        print(f"[launcher] {p}", file=sys.stderr)
    return bool(problems)
