"""`make bench-train` (tools/bench_train.py) times the model and optimizer a run trains with."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent.parent / "tools" / "bench_train.py"


def test_the_benchmark_steps_the_model_the_trainer_builds(ms_cpu, tmp_path, monkeypatch):
    """Training mode, as finetune.trainer.build_model leaves it: the LM head computes the logits once a
    step and keeps them for the backward. The bench used to build its own model in evaluation mode,
    whose backward recomputes them (two vocab-sized matmuls where a run does one), so it understated us."""
    from jobspec.tiny import ensure_tiny_model

    spec = importlib.util.spec_from_file_location("bench_train", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ensure_tiny_model(tmp_path / "model", {"tie_word_embeddings": False})
    vocab = json.loads((tmp_path / "model" / "config.json").read_text())["vocab_size"]
    ids = np.random.default_rng(0).integers(0, vocab, (2, 16)).astype(np.int32)
    batch = {"ids": ids, "labels": ids.copy(), "pos": np.tile(np.arange(16, dtype=np.int32), (2, 1)),
             "seg": np.ones_like(ids)}
    ours = bench.Ours(tmp_path / "model", batch, jit_layers=False)
    head = ours.model.loss_fn
    calls = []
    real = head._logits
    monkeypatch.setattr(head, "_logits", lambda h, w: calls.append(h.shape[0]) or real(h, w))
    first = ours.step()[1]
    assert ours.model.training and calls == [2 * 15]
    assert np.isfinite(first) and ours.step()[1] != first  # the optimizer stepped
