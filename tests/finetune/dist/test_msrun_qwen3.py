"""The real trainer under msrun on a tiny Qwen3 (no QKV bias, per-head q/k norms, head_dim 32 !=
hidden/heads) is the one-process computation: TP 2 x DP 2 as two msrun nodes, and TP 4 (each of the
2 KV heads and its k_norm contribution on two ranks). Compared as the Qwen2 runs in test_msrun_train.py:
per-step losses, eval loss and the exported Hugging Face weights (q_norm/k_norm included)."""
from pathlib import Path

import pytest

import harness
from test_msrun_train import _assert_same_run, _hf, _plan, _run_once

pytestmark = pytest.mark.slow
QWEN3 = {"model_type": "qwen3", "head_dim": 32, "attention_bias": False, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def tmp(module_tmp) -> Path:
    """The one-process reference run on a tiny Qwen3 made by jobspec.tiny."""
    from jobspec.recipe_load import load_recipe
    from jobspec.tiny import ensure_tiny_model

    ensure_tiny_model(module_tmp / "base-model", {**load_recipe("tiny-cpu").model.init, **QWEN3}, 0)
    harness.python(harness.REPO / "finetune" / "worker.py", ["--config", str(_plan(module_tmp, "one", 1, 1))],
                   module_tmp / "one")
    return module_tmp


def test_qwen3_tp2_dp2_on_two_nodes_equals_one_process(tmp):
    out = _run_once(tmp, "tp2dp2", 2, 2, 4, nodes=2)
    _assert_same_run(out, tmp / "one")
    names = _hf(out).keys()
    assert "model.layers.1.self_attn.k_norm.weight" in names and "lm_head.weight" in names
    assert not [n for n in names if n.endswith(".bias")]


def test_qwen3_tp4_replicated_kv_heads_equal_one_process(tmp):
    _assert_same_run(_run_once(tmp, "tp4", 4, 1, 4), tmp / "one")
