"""LoRA end to end on the tiny default (recipes/tiny-cpu-lora.yaml): the base stays frozen, checkpoints
hold the adapters only, resume is exact and refused over another base or adapter shape, the export is
peft's format and the merged hf/ equals base + adapter."""
import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

from finetune.io.checkpoint import CheckpointMismatch
from finetune.run.loop import run
from jobspec.config import resolved_model_dir
from jobspec.recipe_load import load_recipe
from jobspec.tiny import ensure_tiny_model

pytestmark = pytest.mark.slow  # every test reads one or more whole training runs (make test-fast skips them)

# dropout 0 here (the goldens' setting); test_resume_is_exact_with_dropout runs 0.05
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
        run(_recipe(out, **{"train.method": "full", "lora.dropout": "0.05"}))  # FAST's lora.* unset: else refused
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


def test_an_adapter_is_applied_only_to_its_base_and_export_only_from_the_run_s_model(lora_run, tmp_path, capsys):
    """Issue 31 wrong answers 3 and 7: ``generate --adapter OUTPUT_DIR/adapter`` without --model-dir applied the
    adapter to the merged hf/ (twice); ``export`` with another MODEL_DIR shipped that model's tokenizer and merged
    the adapter onto it. Now the adapter goes on its base (the launcher's --base-model), another base is refused
    naming the right one, and export refuses a model directory the run did not train on."""
    from finetune.export import main as export
    from finetune.generate import main

    base, adapter = lora_run / "base-model", lora_run / "adapter"
    common = ["--prompt", "Name a color.", "--max-new-tokens", "6", "--temperature", "0", "--device", "cpu"]
    assert main(["--model-dir", str(lora_run / "hf"), *common]) == 0
    merged = capsys.readouterr().out
    assert main(["--finetuned", str(lora_run / "hf"), "--base-model", str(base), "--adapter", str(adapter),
                 *common]) == 0
    out = capsys.readouterr()
    assert out.out == merged and f"the base model with the LoRA adapter {adapter}: {base}" in out.err
    assert main(["--model-dir", str(lora_run / "hf"), "--adapter", str(adapter), *common]) == 2
    assert f"--model-dir {base}" in capsys.readouterr().err
    other = tmp_path / "other"
    ensure_tiny_model(other, {**load_recipe("tiny-cpu-lora").model.init}, 7)  # the same shapes, other weights
    assert export(["--checkpoint", "latest", "--output-dir", str(lora_run), "--model-dir", str(other),
                   "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert f"trained on the base model {base}" in err and not (tmp_path / "x").exists()


def test_export_of_a_checkpoint_equals_the_run_s_final_export(lora_run, tmp_path, capsys, ms_cpu):
    """``export --checkpoint`` of a LoRA checkpoint: adapter/ and merged hf/ tensor-equal to the run's final
    export of the same step; the merged model loads and gives the same logits; --no-merge: adapter/ only."""
    from finetune.export import main
    from finetune.io.hf_io import load_hf_config, load_weights
    from finetune.model.decoder import DecoderLM, ModelConfig

    base = str(lora_run / "base-model")
    args = ["--checkpoint", "latest", "--output-dir", str(lora_run), "--model-dir", base, "--dtype", "fp32"]
    assert main([*args, "--out", str(tmp_path / "e")]) == 0
    assert "adapter" in capsys.readouterr().out
    for d, f in (("adapter", "adapter_model.safetensors"), ("hf", "model.safetensors")):
        ours, run_s = load_file(str(tmp_path / "e" / d / f)), load_file(str(lora_run / d / f))
        assert ours.keys() == run_s.keys()
        for k in ours:
            np.testing.assert_array_equal(ours[k], run_s[k], err_msg=k)
    assert json.loads((tmp_path / "e" / "adapter" / "adapter_config.json").read_text()) == \
        json.loads((lora_run / "adapter" / "adapter_config.json").read_text())
    ids = np.arange(3, 40, dtype=np.int32).reshape(1, -1)
    logits = []
    for d in (tmp_path / "e" / "hf", lora_run / "hf"):
        model = DecoderLM(ModelConfig.from_dict(load_hf_config(d)))
        load_weights(model, d)
        logits.append(model.logits(ms_cpu.Tensor(ids)).asnumpy())
    np.testing.assert_array_equal(logits[0], logits[1])
    assert main([*args, "--checkpoint", "step_3", "--out", str(tmp_path / "a"), "--no-merge"]) == 0
    assert (tmp_path / "a" / "adapter" / "adapter_model.safetensors").is_file() and not (tmp_path / "a" / "hf").exists()


@pytest.mark.slow  # two short training runs (~2 min here)
def test_resume_is_exact_with_dropout(lora_run, tmp_path):
    """lora.dropout 0.05: the masks are a function of (seed, step, micro-batch, layer, module, rank)
    (lora.MaskKey), so a run resumed from step 3 draws the masks of the uninterrupted run: equal losses
    and adapters. The masks act: the losses differ from the dropout-0 run's."""
    drop = {"lora.dropout": "0.05", "export.merge": "false", "export.check_prompts": ""}
    whole = tmp_path / "whole"
    assert run(_recipe(whole, **drop)) == 0
    assert _losses(whole) != _losses(lora_run)
    out = tmp_path / "resumed"
    shutil.copytree(whole, out)
    shutil.rmtree(out / "checkpoints" / "step_00000006")
    shutil.rmtree(out / "adapter")
    assert run(_recipe(out, **drop)) == 0
    assert _losses(out) == _losses(whole)
    a = load_file(str(whole / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_export_gathers_a_tp2_lora_checkpoint(lora_run, tmp_path):
    """A LoRA checkpoint written under TP 2 (the step-6 adapters cut as a TP-2 run holds them: B of a
    column-parallel layer by rows, A of a row-parallel one by columns) exports to the run's adapter/ and hf/."""
    from safetensors.numpy import save_file

    from finetune.io.lora_io import export_lora_checkpoint

    src, ckpt = lora_run / "checkpoints" / "step_00000006", tmp_path / "step_00000006"
    shutil.copytree(src, ckpt)
    full = load_file(str(src / "model_rank00000.safetensors"))
    ranks: list[dict[str, np.ndarray]] = [{}, {}]
    for name, a in full.items():
        row = ".o_proj." in name or ".down_proj." in name
        axis = (1 if row else None) if ".lora_A." in name else (None if row else 0)
        for t in range(2):
            ranks[t][name] = a if axis is None else np.ascontiguousarray(np.split(a, 2, axis)[t])
    for t in range(2):
        save_file(ranks[t], str(ckpt / f"model_rank{t:05d}.safetensors"))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["layout"] = {"world_size": 2, "tp": 2, "dp": 1}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    identity = json.loads((ckpt / "trainer_state.json").read_text())["identity"]
    export_lora_checkpoint(ckpt, identity, lora_run / "base-model", tmp_path / "e", "fp32", 10**9, True)
    for d, f in (("adapter", "adapter_model.safetensors"), ("hf", "model.safetensors")):
        ours, run_s = load_file(str(tmp_path / "e" / d / f)), load_file(str(lora_run / d / f))
        assert ours.keys() == run_s.keys()
        for k in ours:
            np.testing.assert_array_equal(ours[k], run_s[k], err_msg=k)
