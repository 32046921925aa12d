"""End-to-end training on the tiny default model: loss falls, resume is exact, export loads."""
import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

from finetune.config import load_recipe, resolved_model_dir
from finetune.tiny import ensure_tiny_model
from finetune.train import run

FAST = {"train.max_steps": "6", "train.save_every": "3", "train.log_every": "1", "train.micro_batch_size": "2",
        "train.warmup_steps": "1", "data.seq_len": "128", "data.max_samples": "64", "train.lr": "5e-3"}


def _recipe(out, **extra):
    """The tiny-cpu recipe with its tiny model created as the launcher does (the worker does not)."""
    recipe = load_recipe("tiny-cpu", {"output_dir": str(out), **FAST, **extra})
    ensure_tiny_model(resolved_model_dir(recipe), recipe.model.init, recipe.model.init_seed)
    return recipe


def _losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    assert run(_recipe(out)) == 0
    return out


def test_straight_run_writes_metrics_checkpoints_and_export(straight):
    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s"):
        assert all(np.isfinite(r[key]) for r in records), key
    assert records[-1]["loss"] < records[0]["loss"]
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["first_loss"] == records[0]["loss"]
    assert (straight / "loss.png").stat().st_size > 1000
    hf = straight / "hf"
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (hf / name).is_file(), name
    assert list(hf.glob("*.safetensors"))


def test_resume_from_a_mid_run_checkpoint_is_exact(straight, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(straight, out)
    shutil.rmtree(out / "checkpoints" / "step_00000006")  # as if the job died after step 3's checkpoint
    shutil.rmtree(out / "hf")
    assert run(_recipe(out)) == 0
    assert _losses(out) == _losses(straight)
    a = load_file(str(straight / "checkpoints" / "step_00000006" / "model_rank00000.safetensors"))
    b = load_file(str(out / "checkpoints" / "step_00000006" / "model_rank00000.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_fp16_trains_with_dynamic_loss_scaling(tmp_path):
    out = tmp_path / "fp16"
    assert run(_recipe(out, **{"train.precision": "fp16", "train.max_steps": "3", "train.save_every": "0",
                              "export.dtype": "fp16"})) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss_scale"] for r in records] == [65536.0] * 3
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) for r in records)
    assert records[-1]["loss"] < records[0]["loss"]
    config = json.loads((out / "hf" / "config.json").read_text())
    assert config["torch_dtype"] == "float16"


def test_bf16_on_cpu_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="train.precision=fp32"):
        run(_recipe(tmp_path, **{"train.precision": "bf16"}))
