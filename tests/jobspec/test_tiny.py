"""Tiny seeded model creation (host side: must not import mindspore)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from jobspec.model_layout import full_shapes
from jobspec.tiny import TINY_DEFAULTS, ensure_tiny_model

SMALL = {"vocab_size": 300, "hidden_size": 16, "intermediate_size": 24}


def test_creates_once_and_is_reproducible(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert ensure_tiny_model(a, SMALL, seed=3) is True
    assert ensure_tiny_model(a, SMALL, seed=3) is False
    ensure_tiny_model(b, SMALL, seed=3)
    ensure_tiny_model(c, SMALL, seed=4)
    for f in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_config_weights_and_tokenizer(tmp_path):
    ensure_tiny_model(tmp_path / "m", {"tie_word_embeddings": False, **SMALL}, seed=0)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["hidden_size"] == 16 and cfg["num_key_value_heads"] == 2 and cfg["eos_token_id"] == 151645
    assert cfg["tie_word_embeddings"] is False and cfg["rope_theta"] == 1e6
    tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
    assert {k: v.shape for k, v in tensors.items()} == full_shapes(cfg)
    assert "lm_head.weight" in tensors
    assert all(v.dtype == np.float32 for v in tensors.values())
    assert (tensors["model.norm.weight"] == 1).all() and (tensors["model.layers.1.self_attn.k_proj.bias"] == 0).all()
    assert abs(float(tensors["model.embed_tokens.weight"].std()) - 0.02) < 0.002
    tok = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    assert tok["added_tokens_decoder"]["151645"]["content"] == "<|im_end|>"


def test_defaults_match_qwen25_tokenizer():
    assert TINY_DEFAULTS["vocab_size"] == 151936 and TINY_DEFAULTS["tie_word_embeddings"] is True
    shapes = full_shapes(TINY_DEFAULTS)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (32, 64) and "lm_head.weight" not in shapes


def test_refuses_to_overwrite_foreign_directory(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="holds no complete model"):
        ensure_tiny_model(tmp_path / "m", SMALL, seed=0)
    assert (tmp_path / "m" / "notes.txt").read_text() == "mine"
    (tmp_path / "e").mkdir()  # an empty directory is fine
    assert ensure_tiny_model(tmp_path / "e", SMALL, seed=0)
