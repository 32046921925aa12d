"""LoRA end to end on the tiny default (recipes/tiny-cpu-lora.yaml): the base stays frozen, checkpoints
hold the adapters only, resume is exact and refused over another base or adapter shape, the export is
peft's format and the merged hf/ equals base + adapter."""
import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

from finetune.checkpoint import CheckpointMismatch
from finetune.train import run
from jobspec.config import load_recipe, resolved_model_dir
from jobspec.tiny import ensure_tiny_model

pytestmark = pytest.mark.slow  # every test reads one or more whole training runs (make test-fast skips them)

# dropout 0: its masks come from MindSpore's global RNG, which a checkpoint does not restore (docs/lora.md)
FAST = {"train.max_steps": "6", "train.save_every": "3", "train.log_every": "1", "train.micro_batch_size": "2",
        "train.warmup_steps": "1", "data.seq_len": "128", "data.max_samples": "64", "lora.dropout": "0"}


def _recipe(out, **extra):
    recipe = load_recipe("tiny-cpu-lora", {"output_dir": str(out), **FAST, **extra})
    ensure_tiny_model(resolved_model_dir(recipe), recipe.model.init, recipe.model.init_seed)
    return recipe


def _losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def lora_run(module_tmp):
    assert run(_recipe(module_tmp)) == 0
    return module_tmp


def test_loss_falls_and_checkpoints_hold_only_the_adapters(lora_run):
    losses = _losses(lora_run)
    assert len(losses) == 6 and losses[-1] < losses[0]
    saved = load_file(str(lora_run / "checkpoints" / "step_00000006" / "model_rank00000.safetensors"))
    assert len(saved) == 2 * 7 * 2 and all(".lora_A." in k or ".lora_B." in k for k in saved)


def test_export_is_peft_s_format_and_merged_equals_base_plus_adapter(lora_run):
    cfg = json.loads((lora_run / "adapter" / "adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"]) == ("LORA", 8, 16.0)
    assert (lora_run / "adapter" / "tokenizer.json").is_file()
    adapter = load_file(str(lora_run / "adapter" / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in adapter and len(adapter) == 28
    base = load_file(str(lora_run / "base-model" / "model.safetensors"))
    merged = load_file(str(lora_run / "hf" / "model.safetensors"))
    assert merged.keys() == base.keys()
    q = "model.layers.1.self_attn.q_proj"
    a, b = (adapter[f"base_model.model.{q}.lora_{x}.weight"] for x in "AB")
    assert np.abs(b).max() > 0  # trained away from peft's zero init
    np.testing.assert_allclose(merged[q + ".weight"], base[q + ".weight"] + 2.0 * b @ a, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(merged["model.norm.weight"], base["model.norm.weight"])  # frozen, no adapter


def test_resume_is_exact_and_refused_over_other_adapters(lora_run, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(lora_run, out)
    shutil.rmtree(out / "checkpoints" / "step_00000006")  # as if the job died after step 3's checkpoint
    for d in ("hf", "adapter"):
        shutil.rmtree(out / d)
    with pytest.raises(CheckpointMismatch, match="train.method"):
        run(_recipe(out, **{"lora.r": "4"}))
    with pytest.raises(CheckpointMismatch, match="train.method"):
        run(_recipe(out, **{"train.method": "full"}))
    assert run(_recipe(out, **{"export.check_prompts": ""})) == 0
    assert _losses(out) == _losses(lora_run)
    a = load_file(str(lora_run / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_generate_with_the_adapter_answers_as_the_merged_model(lora_run, tmp_path, capsys):
    from finetune.generate import main

    common = ["--prompt", "Name a color.", "--max-new-tokens", "6", "--temperature", "0", "--device", "cpu"]
    assert main(["--model-dir", str(lora_run / "base-model"), "--adapter", str(lora_run / "adapter"), *common]) == 0
    with_adapter = capsys.readouterr().out
    assert main(["--model-dir", str(lora_run / "hf"), *common]) == 0
    assert capsys.readouterr().out == with_adapter
    assert main(["--model-dir", str(lora_run / "base-model"), "--adapter", str(tmp_path), *common]) == 2
    assert "adapter_config.json" in capsys.readouterr().err
