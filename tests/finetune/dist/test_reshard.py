"""Checkpoints across layouts under msrun (tiny Qwen2, CPU workers): a TP2 x DP2 run's checkpoint
resumes under TP1 x DP2 and TP1 x DP1 and continues exactly as the TP2 x DP2 run did; exporting its
final checkpoint gives the files the run itself exported.

Same data, seed and global batch (4 sequences) in every layout; the sharded optimizer state is
re-cut for the new DP group (finetune/io/reshard.py).
"""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import harness
from jobspec.config import to_dict
from jobspec.recipe_load import load_recipe

pytestmark = pytest.mark.slow
WORKER = harness.REPO / "finetune" / "worker.py"
STEPS = 5


def _plan(tmp: Path, name: str, tp: int, dp: int) -> Path:
    over = {"output_dir": str(tmp / name), "model.dir": str(tmp / "base-model"), "data.cache_dir": str(tmp / "cache"),
            "data.seq_len": "64", "data.max_samples": "48", "train.micro_batch_size": "2",
            "train.grad_accum": str(2 // dp), "train.max_steps": str(STEPS), "train.log_every": "1",
            "train.warmup_steps": "1", "train.lr": "5e-3", "train.save_every": "2", "train.keep_checkpoints": "5",
            "parallel.tp": str(tp), "parallel.dp": str(dp), "export.dtype": "fp32"}
    (tmp / name).mkdir(parents=True, exist_ok=True)
    plan = tmp / name / "plan.json"
    plan.write_text(json.dumps({"recipe": to_dict(load_recipe("tiny-cpu", over))}))
    return plan


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _hf(d: Path) -> dict[str, np.ndarray]:
    return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def _resume(tmp: Path, name: str, tp: int, dp: int, step: int) -> Path:
    """A new run of layout tp x dp whose only checkpoint is the TP2 x DP2 run's ``step``."""
    plan = _plan(tmp, name, tp, dp)
    ckpt = f"step_{step:08d}"
    shutil.copytree(tmp / "tp2dp2" / "checkpoints" / ckpt, tmp / name / "checkpoints" / ckpt)
    if tp * dp == 1:
        harness.python(WORKER, ["--config", str(plan)], tmp / name, timeout=900)
    else:
        harness.msrun(WORKER, ["--config", str(plan)], tp * dp, tmp / name, timeout=900)
    return tmp / name


def _assert_continues(got: Path, ref: Path, after: int) -> None:
    a, b = _losses(got), _losses(ref)
    assert sorted(a) == list(range(after + 1, STEPS + 1))
    np.testing.assert_allclose([a[s] for s in sorted(a)], [b[s] for s in sorted(a)], rtol=1e-4)
    wa, wb = _hf(got / "hf"), _hf(ref / "hf")
    assert wa.keys() == wb.keys() and wa
    for k in wa:  # as in test_msrun_train: Adam may turn float noise into a few elements off by < lr
        off = ~np.isclose(wa[k], wb[k], rtol=1e-4, atol=1e-4)
        assert off.sum() <= max(1, wa[k].size // 10**6), (k, int(off.sum()))
        np.testing.assert_allclose(wa[k], wb[k], rtol=0, atol=5e-3, err_msg=k)


@pytest.fixture(scope="module")
def tmp(module_tmp) -> Path:
    """The TP2 x DP2 run (4 workers, checkpoints at steps 2, 4 and 5)."""
    tmp = module_tmp
    from jobspec.tiny import ensure_tiny_model

    ensure_tiny_model(tmp / "base-model", load_recipe("tiny-cpu").model.init, 0)
    harness.msrun(WORKER, ["--config", str(_plan(tmp, "tp2dp2", 2, 2))], 4, tmp / "tp2dp2", timeout=900)
    return tmp


def test_tp2dp2_checkpoint_resumes_under_tp1dp2_and_tp1(tmp):
    _assert_continues(_resume(tmp, "tp1dp2", 1, 2, 2), tmp / "tp2dp2", after=2)  # sharded -> re-sharded
    _assert_continues(_resume(tmp, "tp1", 1, 1, 4), tmp / "tp2dp2", after=4)  # sharded -> one process


def test_export_of_a_tp2dp2_checkpoint_is_the_runs_export(tmp):
    from finetune.export import main

    out = tmp / "exported"
    assert main(["--checkpoint", "latest", "--output-dir", str(tmp / "tp2dp2"), "--model-dir",
                 str(tmp / "base-model"), "--out", str(out), "--dtype", "fp32"]) == 0
    files = sorted(p.name for p in (tmp / "tp2dp2" / "hf").iterdir())
    assert files == sorted(p.name for p in out.iterdir())
    for f in files:
        assert (out / f).read_bytes() == (tmp / "tp2dp2" / "hf" / f).read_bytes(), f
