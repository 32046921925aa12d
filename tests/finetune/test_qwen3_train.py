"""A tiny Qwen3 goes through `make train MODEL_DIR=<it> DATA=...` (the launcher, as a user runs it):
preflight accepts it, it trains, the first loss equals transformers' on the same batch
(tools/make_qwen3_golden.py) and the export is a Qwen3ForCausalLM directory with its q/k norms."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "finetune" / "golden" / "qwen3-e2e"

pytestmark = pytest.mark.slow


def test_a_tiny_qwen3_trains_through_the_launcher_from_transformers_first_loss(tmp_path):
    from jobspec.tiny import ensure_tiny_model

    g = json.loads((GOLDEN / "golden.json").read_text())
    model_dir = tmp_path / "qwen3-tiny"
    ensure_tiny_model(model_dir, g["overrides"], 0)  # the tensors transformers saved (make_qwen3_golden.py)
    out = tmp_path / "out"
    overrides = f"data.seq_len={g['seq_len']} data.val_size=0 train.micro_batch_size=1 train.grad_accum=1 " \
                "train.max_steps=2 train.save_every=0 train.eval_every=0 train.warmup_steps=1"
    env = {**os.environ, "MODEL_DIR": str(model_dir), "DATA": str(GOLDEN / "data.json"), "OUTPUT_DIR": str(out),
           "OVERRIDES": overrides, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "launcher", "train"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ok      model " in proc.stdout + proc.stderr  # preflight accepts a Qwen3 directory
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 2
    np.testing.assert_allclose(steps[0]["loss"], g["first_loss"], rtol=1e-5)
    config = json.loads((out / "hf" / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    exported = load_file(str(out / "hf" / "model.safetensors"))
    base = load_file(str(model_dir / "model.safetensors"))
    assert exported.keys() == base.keys() and "model.layers.1.self_attn.q_norm.weight" in exported
    assert not np.array_equal(exported["model.layers.1.self_attn.q_norm.weight"],
                              base["model.layers.1.self_attn.q_norm.weight"])  # trained
