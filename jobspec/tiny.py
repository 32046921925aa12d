"""Create a tiny seeded random-init Qwen2 or Qwen3 model in Hugging Face layout (no mindspore import).

The launcher calls :func:`ensure_tiny_model` on the host, so this module needs only numpy,
safetensors and json. The model uses the bundled Qwen2.5 tokenizer (``assets/tokenizer``).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray
from safetensors.numpy import save_file

from jobspec.family import FAMILIES, family_of
from jobspec.fsutil import atomic_dir
from jobspec.model_layout import full_shapes

TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

TINY_DEFAULTS: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "float32",
}

GENERATION_CONFIG: dict[str, Any] = {
    "bos_token_id": 151643,
    "pad_token_id": 151643,
    "eos_token_id": [151645, 151643],
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "repetition_penalty": 1.05,
}


def random_weights(config: dict[str, Any], seed: int, std: float = 0.02) -> dict[str, NDArray[Any]]:
    """Seeded init: normal(0, std) matrices, norms 1, biases 0 (fp32)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in full_shapes(config).items():
        if name.endswith("norm.weight"):
            out[name] = np.ones(shape, np.float32)
        elif name.endswith(".bias"):
            out[name] = np.zeros(shape, np.float32)
        else:
            out[name] = (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)
    return out


def tiny_config(overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json of the tiny model that ``model.init`` = ``overrides`` creates."""
    config = {**TINY_DEFAULTS, **(overrides or {})}
    family = FAMILIES.get(config.get("model_type", ""))
    if family and "architectures" not in (overrides or {}):
        config["architectures"] = [family.architecture]
    return config


def _is_complete(model_dir: Path) -> bool:
    return all((model_dir / f).is_file() for f in ("config.json", "model.safetensors", "generation_config.json",
                                                    *TOKENIZER_FILES))


def ensure_tiny_model(model_dir: str | os.PathLike[str], overrides: dict[str, Any] | None = None,
                      seed: int = 0, std: float = 0.02) -> bool:
    """Create a seeded tiny model at ``model_dir`` once; False when a complete one exists. Qwen2 unless
    ``overrides`` set ``model_type`` (e.g. ``{"model_type": "qwen3", "head_dim": 32}``).

    Written to a temporary sibling directory and renamed, so a crash never leaves half a model.
    """
    target = Path(model_dir)
    if _is_complete(target):
        return False
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target}: exists but holds no complete model (config.json, model.safetensors, "
                              "tokenizer.json, ...); empty it or set model.dir to a new directory")
    config = tiny_config(overrides)
    family_of(config)  # refuses a model_type this trainer does not implement
    with atomic_dir(target, "base-model") as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
        for f in TOKENIZER_FILES:
            shutil.copyfile(TOKENIZER_DIR / f, tmp / f)
        save_file(random_weights(config, seed, std), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return True
