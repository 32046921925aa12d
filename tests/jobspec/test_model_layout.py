"""The one Qwen2 parameter table: shapes, TP slices, checks, and who derives from it."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from jobspec.model_layout import full_shapes, local_shapes, param_count, param_table, tp_layout, tp_problems

REPO = Path(__file__).resolve().parents[2]
QWEN7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
              num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
SMALL = dict(vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)


def test_qwen7b_count_and_shapes_are_the_published_ones():
    assert param_count(QWEN7B) == 7_615_616_512
    shapes = full_shapes(QWEN7B)
    assert shapes["model.layers.27.self_attn.k_proj.weight"] == (512, 3584)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (3584, 18944) and shapes["lm_head.weight"] == (152064, 3584)
    assert len(param_table(QWEN7B)) == 1 + 28 * 12 + 2
    tied = dict(QWEN7B, tie_word_embeddings=True)
    assert "lm_head.weight" not in full_shapes(tied) and param_count(QWEN7B) - param_count(tied) == 152064 * 3584


@pytest.mark.parametrize("tp,nkv", [(2, 2), (4, 2), (2, 1)])
def test_tp_layout_tiles_every_tensor(tp, nkv):
    """Each rank's slices tile the full tensor; replicated KV heads have exactly one owner."""
    cfg = dict(SMALL, num_key_value_heads=nkv)
    layouts = [tp_layout(cfg, tp, r, vocab_parallel=True) for r in range(tp)]
    assert "lm_head.weight" in layouts[0] and "model.embed_tokens.weight" not in tp_layout(cfg, tp, 0)
    assert "model.norm.weight" not in layouts[0]
    hd = 8
    for name, full in (("model.layers.0.self_attn.q_proj.weight", 32), ("model.layers.0.mlp.down_proj.weight", 64),
                       ("model.layers.0.self_attn.k_proj.weight", nkv * hd), ("model.embed_tokens.weight", 12),
                       ("lm_head.weight", 12)):
        covered = np.zeros(full, int)
        for lay in layouts:
            s = lay[name]
            covered[s.start:s.start + s.size] += int(s.owner)
        assert (covered == 1).all(), name
    assert layouts[0]["model.layers.0.self_attn.o_proj.weight"].axis == 1
    if tp > nkv:  # rank r's q heads use kv head (r * nkv) // tp
        for r, lay in enumerate(layouts):
            assert lay["model.layers.0.self_attn.k_proj.weight"].start == (r * nkv // tp) * hd
    local = local_shapes(cfg, tp, vocab_parallel=True)
    assert local["model.layers.0.self_attn.k_proj.weight"] == (max(nkv // tp, 1) * hd, 32)
    assert local["model.layers.0.mlp.down_proj.weight"] == (32, 64 // tp)


def test_tp_problems_are_all_reported_at_once():
    cfg = dict(SMALL, num_attention_heads=6, num_key_value_heads=3, intermediate_size=60, vocab_size=13)
    assert tp_problems(cfg, 3) == []
    problems = tp_problems(cfg, 4, vocab_parallel=True)
    assert len(problems) == 3, problems  # heads, kv heads (4 > 3, not a multiple), vocab
    assert "num_attention_heads=6" in problems[0][0] and "vocab_parallel=false" in problems[2][1]
    with pytest.raises(ValueError, match=r"parallel.tp=4 must divide num_attention_heads=6 \(e.g. parallel.tp=3\)"):
        tp_layout(cfg, 4, 0)
    # tp <= kv heads that it does not divide: 6 heads, 6 kv heads, tp 4 -> caught (the model missed it)
    assert any("num_key_value_heads=6" in p for p, _ in tp_problems(dict(cfg, num_key_value_heads=6), 4))
    assert tp_problems(QWEN7B, 4) == [] and tp_problems(dict(QWEN7B, num_attention_heads=32), 8) == []  # kv copies


def test_model_does_not_import_tiny():
    tree = ast.parse((REPO / "finetune" / "model" / "decoder.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "jobspec.tiny" not in imported and "jobspec.model_layout" in imported
