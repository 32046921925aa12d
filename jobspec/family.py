"""The model families this trainer implements, one :class:`Family` record each: everything that differs
between them, read by the parameter table (jobspec/model_layout.py), the model (finetune/model/decoder.py), the chat
template (jobspec/data/template.py), generation and the tiny model. Adding a family is one record here plus
whatever new code its fields name (docs/model-families.md). Pure Python.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Family:
    """One supported ``model_type`` of a Hugging Face config.json."""

    model_type: str
    architecture: str  # the Hugging Face class named in config.json's "architectures"
    qkv_bias: bool  # the q/k/v projections carry biases
    qk_norm: bool  # an RMSNorm over each query and key head before RoPE
    rope: str  # the RoPE kind (config.json's rope_type) finetune/model/decoder.py computes for it
    template: str  # the chat template's name in jobspec/data/template.py
    stop_tokens: tuple[str, ...]  # generation stops at these (besides generation_config.json's eos_token_id)
    pad_token: str  # left-pads a batch of prompts


_CHATML_STOPS = ("<|im_end|>", "<|endoftext|>")
FAMILIES = {f.model_type: f for f in (
    Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True, qk_norm=False, rope="default", template="qwen2.5",
           stop_tokens=_CHATML_STOPS, pad_token="<|endoftext|>"),
    Family("qwen3", "Qwen3ForCausalLM", qkv_bias=False, qk_norm=True, rope="default", template="qwen3",
           stop_tokens=_CHATML_STOPS, pad_token="<|endoftext|>"),
)}
DEFAULT = FAMILIES["qwen2"]  # a bare config dict without model_type or architectures; the bundled tokenizer's
SUPPORTED = "Qwen2 / Qwen2.5 (incl. Coder, Math: model_type qwen2, Qwen2ForCausalLM) and Qwen3 dense " \
            "(model_type qwen3, Qwen3ForCausalLM)"


def family_of(config: dict[str, Any]) -> Family:
    """The family of a config.json (``model_type``, else the architecture; neither: :data:`DEFAULT`).

    Raises ValueError naming the model type and what is supported for any other family (Llama,
    Qwen2-MoE, Qwen3-MoE, Qwen2-VL, ...)."""
    archs = config.get("architectures") or []
    mt = config.get("model_type")
    if mt is None:
        known = [f for f in FAMILIES.values() if f.architecture in archs]
        mt = known[0].model_type if known else (DEFAULT.model_type if not archs else None)
    fam = FAMILIES.get(str(mt)) if mt is not None else None
    if fam is not None and not fam.qkv_bias and config.get("attention_bias"):
        raise ValueError(f"config.json: attention_bias true is not supported for model_type {mt!r} (no released "
                         "model has it; its o_proj bias would be dropped); use a model with attention_bias false")
    if fam is None or (archs and fam.architecture not in archs):
        what = f"model_type {mt!r}" if mt else "architecture"
        raise ValueError(f"config.json: {what} ({', '.join(map(str, archs)) or 'no architectures'}) is not "
                         f"supported; this trainer implements {SUPPORTED} (set MODEL_DIR to such a model, "
                         "e.g. Qwen/Qwen3-8B or Qwen/Qwen2.5-7B-Instruct)")
    return fam


def family_in(model_dir: str | Path) -> Family:
    """The family of ``model_dir``'s config.json; :data:`DEFAULT`
    where there is none (the bundled tokenizer's directory). Raises ValueError naming that config.json when it is
    unreadable, not JSON or of another family."""
    config = Path(model_dir) / "config.json"
    if not config.exists():
        return DEFAULT
    try:
        return family_of(json.loads(config.read_text()))
    except (OSError, ValueError, AttributeError) as e:  # unreadable, not JSON, not a mapping, another family
        raise ValueError(f"{config}: the chat format (the model family's) cannot be told from it: {e}") from None
