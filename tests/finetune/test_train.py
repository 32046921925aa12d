"""End-to-end training on the tiny default model: loss falls, resume is exact, export loads."""
import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

from finetune.run.loop import run
from jobspec.checkpoint_index import unhealthy
from jobspec.config import resolved_model_dir
from jobspec.finish import finished
from jobspec.memory import MemoryEstimate
from jobspec.recipe_load import load_recipe
from jobspec.rundir import RunDir
from jobspec.tiny import ensure_tiny_model

# export.check_max_new_tokens 4: the inference check answers every prompt, in a fraction of the default 64 tokens
FAST = {"train.max_steps": "6", "train.save_every": "3", "train.log_every": "1", "train.micro_batch_size": "2",
        "train.warmup_steps": "1", "data.seq_len": "128", "data.max_samples": "64", "train.lr": "5e-3",
        "export.check_max_new_tokens": "4"}


def _recipe(out, **extra):
    """The tiny-cpu recipe with its tiny model created as the launcher does (the worker does not)."""
    recipe = load_recipe("tiny-cpu", {"output_dir": str(out), **FAST, **extra})
    ensure_tiny_model(resolved_model_dir(recipe), recipe.model.init, recipe.model.init_seed)
    return finished(recipe)  # as the launcher writes it (trainer.setup reads its paths)


def _losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(module_tmp):
    assert run(_recipe(module_tmp, **{"train.profile_steps": "2,3"})) == 0
    return module_tmp


def test_logged_steps_carry_mfu_time_breakdown_memory_and_eval(straight):
    """Issue 12 items 1, 3, 6: the record keys the reports read, the held-out eval at the end, the profile."""
    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        assert 0 < r["mfu"] < 1 and r["peak_memory_bytes"] > 2**20
        times = [r[f"time_{k}_s"] for k in ("data", "fwd_bwd", "optimizer", "comm")]
        assert all(x >= 0 for x in times) and r["time_fwd_bwd_s"] > 0
    assert [r["step"] for r in records if "eval_loss" in r] == [6]  # eval_every 20 > 6 steps: at the end only
    assert records[-1]["eval_tokens"] > 0 and 0 < records[-1]["eval_loss"] < 20
    assert (straight / "profile" / "rank0.prof").stat().st_size > 0
    assert "accumulate" in (straight / "profile" / "rank0.txt").read_text()
    # issue 30 item 4: the step-1 memory record (CPU: the peak RSS, MindSpore reports no device bytes), in the summary
    first = records[0]
    assert first["memory_source"] == "rss" and first["memory_peak_rss_bytes"] > 2**20
    assert MemoryEstimate.from_parts(first["memory_estimate_terms"]).total == first["memory_estimate_bytes"] > 2**20
    assert "memory_source" not in records[1]
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["memory_estimate_bytes"] == first["memory_estimate_bytes"]


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
    samples = [json.loads(x) for x in (straight / "samples.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(samples) == 5 and all(r["response"] for r in samples)  # the inference check on the export


@pytest.mark.slow  # a whole training run or two (make test-fast skips it)
def test_compiled_layers_train_and_resume_as_the_op_by_op_layers(straight, tmp_path, capsys):
    """train.compile_layers (on by default on CPU: the straight run's layers are graphs): the op-by-op
    layers give the same losses within fp32 rounding, also resumed from the compiled run's checkpoint."""
    fresh, resumed = tmp_path / "fresh", tmp_path / "resumed"
    assert run(_recipe(fresh, **{"train.compile_layers": "false", "train.max_steps": "3"})) == 0
    assert "runs as one graph" not in capsys.readouterr().out
    np.testing.assert_allclose(_losses(fresh), _losses(straight)[:3], rtol=1e-5)
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000006")  # resumed at step 3
    shutil.rmtree(resumed / "hf")
    assert run(_recipe(resumed, **{"train.compile_layers": "false"})) == 0
    np.testing.assert_allclose(_losses(resumed), _losses(straight), rtol=1e-5)


@pytest.mark.slow  # a whole training run or two (make test-fast skips it)
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


@pytest.mark.slow  # a whole training run or two (make test-fast skips it)
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
    # fp16 weights written in place from the fp32 masters: compiled layers (the default) see every update
    opbyop = tmp_path / "fp16-opbyop"
    assert run(_recipe(opbyop, **{"train.precision": "fp16", "train.max_steps": "3", "train.save_every": "0",
                                  "train.compile_layers": "false", "export.check_prompts": ""})) == 0
    np.testing.assert_allclose(_losses(out), _losses(opbyop), rtol=1e-3)


def test_bf16_on_cpu_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="train.precision=fp32"):
        run(_recipe(tmp_path, **{"train.precision": "bf16"}))


def test_the_worker_does_not_create_the_tiny_model(tmp_path):
    """The launcher creates it (model.init); a worker without a model directory says what to set."""
    with pytest.raises(FileNotFoundError, match="MODEL_DIR"):
        run(load_recipe("tiny-cpu", {"output_dir": str(tmp_path), **FAST}))
    assert not (tmp_path / "base-model").exists()


@pytest.mark.slow  # a whole training run or two (make test-fast skips it)
def test_a_finished_run_continued_with_more_steps_equals_one_longer_run(tmp_path):
    """Issue 10 item 7: the final checkpoint holds the data position of the next step, not one further."""
    const = {"train.schedule": "constant", "train.warmup_steps": "0", "train.save_every": "0"}
    assert run(_recipe(tmp_path / "long", **const)) == 0
    short = tmp_path / "short"
    assert run(_recipe(short, **{**const, "train.max_steps": "3"})) == 0
    assert run(_recipe(short, **const)) == 0
    assert len(_losses(short)) == 6
    assert _losses(short) == _losses(tmp_path / "long")


@pytest.mark.slow  # a whole training run or two (make test-fast skips it)
@pytest.mark.parametrize("log_every, found", [("1", "2 consecutive steps with non-finite gradients, found at step 3"),
                                              ("4", "3 consecutive steps with non-finite gradients, found at step 4")])
def test_a_diverging_run_stops_nonzero_and_exports_nothing(tmp_path, capsys, log_every, found):
    """Issue 10 item 5: train.max_bad_steps consecutive non-finite steps end the run (exit 3), seen
    at the next sync point (steps 2, 3, ... are non-finite; the skips are counted on the device)."""
    out = tmp_path / "diverged"
    assert run(_recipe(out, **{"train.lr": "1e38", "train.max_bad_steps": "2", "train.save_every": "0",
                               "train.log_every": log_every})) == 3
    text = capsys.readouterr().out
    assert found + " (loss scale 1)" in text
    assert "train.lr" in text and "train.max_bad_steps" in text
    assert not (out / "hf").exists() and not list(out.glob("checkpoints/step_*"))


@pytest.mark.slow  # a whole training run or two (make test-fast skips it)
@pytest.mark.parametrize("grad_accum", ["2", "8"])
@pytest.mark.parametrize("on_device, want", [(True, [0, 4, 4]), (False, [0, 0, 1, 2, 3, 4, 4])])
def test_a_step_reads_the_device_only_at_sync_points(tmp_path, monkeypatch, on_device, want, grad_accum):
    """Issue 12 item 8: no loss copy per micro-batch, no stop all-reduce and no norm read per step
    (clip and skip stay on the device, as on Ascend); one read at a logged step. On CPU (the host
    gate, where kernels are synchronous) the norm is read once per step, nothing else. The update
    check (optim.UpdateCheck) adds one read before the first step and one at the first sync point.
    Issue 30 item 7: the same at grad_accum 8, and no ``ops.nonzero`` (its output's shape is a device
    read) per micro-batch: the loss's labelled rows come from the labels' host array."""
    import mindspore as ms

    from finetune.dist import init_distributed
    from finetune.run.loop import StopFlag, train_loop
    from finetune.run.progress import Reporter
    from finetune.run.training import setup
    from jobspec.layout import Layout

    # the layers op by op, as on Ascend: compiling a layer (CPU's default) reads host data at the first call
    recipe = _recipe(tmp_path, **{"train.max_steps": "4", "train.log_every": "4", "train.save_every": "0",
                                  "train.grad_accum": grad_accum, "data.val_size": "0",
                                  "train.compile_layers": "false"})
    trainer = setup(recipe.resolved(1, "cpu"), init_distributed(Layout()), ms.float32, RunDir(tmp_path))
    assert trainer.opt.gate.on_device is False  # CPU's default
    trainer.opt.gate.on_device = on_device
    trainer.model.loss_fn.host_gemm = False  # CPU's head matmuls read host memory, which waits for no device
    trainer.opt.gate.in_place = False  # so does the host AdamW kernel (finetune/optim/host.py)
    trainer.model.loss_fn.tied = trainer.model.model.embed_tokens.lookup = None  # and the tied gradient's
    # in-place buffer (parallel/vocab.py TiedGradient: host memory only; Ascend sums autodiff's two d weights)
    reporter = Reporter(trainer)
    reads = []
    for name in ("asnumpy", "_item", "_tolist"):
        original = getattr(ms.Tensor, name)
        monkeypatch.setattr(ms.Tensor, name, lambda self, *a, _f=original, **k: (reads.append(trainer.step),
                                                                                 _f(self, *a, **k))[1])
    original_nonzero = ms.ops.nonzero
    monkeypatch.setattr(ms.ops, "nonzero", lambda *a, **k: (reads.append(("nonzero", trainer.step)),
                                                            original_nonzero(*a, **k))[1])
    assert train_loop(trainer, reporter, StopFlag()) == 0
    assert reads == want  # the logged step 4 (and each step's norm on the host gate)


@pytest.mark.slow  # a whole training run or two (make test-fast skips it)
def test_a_run_whose_optimizer_changes_no_weight_fails_at_the_first_sync_point(tmp_path, monkeypatch):
    """Issue 18 section 1.3: an optimizer kernel whose results do not reach the weights (the old
    optimizer under a kernel that does not write its inputs) stops the run at the first sync point
    with what it means, instead of hours of flat loss."""
    import mindspore as ms

    from finetune.dist import init_distributed
    from finetune.optim import update
    from finetune.run.loop import StopFlag, train_loop
    from finetune.run.progress import Reporter
    from finetune.run.training import setup
    from jobspec.layout import Layout

    recipe = _recipe(tmp_path, **{"train.max_steps": "4", "train.log_every": "2", "train.save_every": "0",
                                  "data.val_size": "0"})
    trainer = setup(recipe.resolved(1, "cpu"), init_distributed(Layout()), ms.float32, RunDir(tmp_path))
    monkeypatch.setattr(update, "adamw_update_host", lambda *a, **k: None)  # CPU's kernel: steps in place
    with pytest.raises(RuntimeError, match=r"applied 2 step\(s\) up to step 2 but no master weight changed"):
        train_loop(trainer, Reporter(trainer), StopFlag())


def test_eval_loss_is_token_weighted_and_independent_of_the_dp_split(straight):
    """Every validation sample once: the shares of 1, 2 or 3 DP ranks and micro-batch sizes 1 or 4 sum
    to the same loss and tokens (the DP sum itself is dist.dp_totals, the loss all-reduce)."""
    import mindspore as ms

    from finetune.dist import RankInfo
    from finetune.model.decoder import DecoderLM, ModelConfig
    from finetune.run.training import BATCH_KEYS
    from jobspec.data.batching import BatchLoader
    from jobspec.data.cache import VAL_INDEX
    from jobspec.data.template import IGNORE

    config = json.loads((straight / "base-model" / "config.json").read_text())
    model = DecoderLM(ModelConfig.from_dict(config), RankInfo())
    cache = next(p.parent for p in (straight / "data").rglob(VAL_INDEX))
    results = []
    for dp, mbs in ((1, 1), (2, 4), (3, 2)):
        loss = tokens = 0.0
        for r in range(dp):
            loader = BatchLoader(cache, 128, mbs, 1, dp, r, 42, index_name=VAL_INDEX)
            for mb in loader.eval_micro_batches():
                loss += float(model(*(ms.Tensor(mb[k], ms.int32) for k in BATCH_KEYS)).asnumpy())
                tokens += int((mb["labels"][:, 1:] != IGNORE).sum())
        results.append((loss / tokens, tokens))
    assert results[0][1] > 0 and all(n == results[0][1] for _, n in results)
    np.testing.assert_allclose([x for x, _ in results], results[0][0], rtol=1e-5)
    from types import SimpleNamespace

    from finetune.run.progress import evaluate

    t = SimpleNamespace(model=model, rank=RankInfo(), zero3=None, val_loader=BatchLoader(cache, 128, 2, 1, 1, 0, 42,
                                                                                index_name=VAL_INDEX))
    model.set_train(True)  # as the trainer leaves it
    got = evaluate(t)
    assert got["eval_tokens"] == results[0][1] and got["eval_loss"] == pytest.approx(results[0][0], rel=1e-5)
    # eval forwards run in eval mode (a training-mode forward would keep its logits for a backward)
    assert model.loss_fn.kept is None and model.training


@pytest.mark.slow  # a whole training run or two (make test-fast skips it)
def test_early_stop_patience_survives_a_resume(tmp_path, capsys):
    """The best eval loss and the evaluations since it are in the checkpoint: a run that ended after 3
    evaluations (the best, then 2 without gain), continued, stops at the 4th as one uninterrupted run
    would (a reset counter would take the resumed run's first eval as a new best and train on)."""
    out = tmp_path / "patience"
    flat = {"train.lr": "1e-12", "train.schedule": "constant", "train.eval_every": "1",
            "train.early_stop_patience": "3", "train.save_every": "0"}
    assert run(_recipe(out, **flat, **{"train.max_steps": "3"})) == 0  # evals 1 (best), 2, 3: 2 without gain
    capsys.readouterr()
    assert run(_recipe(out, **flat)) == 0
    assert "early stop at step 4" in capsys.readouterr().out
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


@pytest.mark.slow  # a whole training run or two (make test-fast skips it)
def test_early_stop_when_the_eval_loss_stops_improving(tmp_path, capsys):
    """train.early_stop_patience=1 with a learning rate too small to move the eval loss: stop at the
    second evaluation, then the usual final checkpoint and export."""
    out = tmp_path / "early"
    assert run(_recipe(out, **{"train.lr": "1e-12", "train.eval_every": "1", "train.early_stop_patience": "1",
                              "train.save_every": "0"})) == 0
    assert "early stop at step 2" in capsys.readouterr().out
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert (out / "checkpoints" / "step_00000002").is_dir() and (out / "hf").is_dir()


@pytest.mark.slow  # a whole training run or two (make test-fast skips it)
def test_no_checkpoint_during_a_run_of_bad_steps_and_the_healthy_one_is_kept(tmp_path, capsys):
    """issue 19.11: with save_every below max_bad_steps and keep_checkpoints=1, the checkpoints written while
    the steps were non-finite pruned the last good one; a rerun resumed the blown-up weights."""
    out = tmp_path / "diverged"
    assert run(_recipe(out, **{"train.lr": "1e38", "train.max_bad_steps": "3", "train.save_every": "1",
                               "train.keep_checkpoints": "1", "train.log_every": "1"})) == 3
    text = capsys.readouterr().out
    assert "no checkpoint at step 2: the last 1 steps had non-finite gradients" in text
    # step 1's update made every later loss non-finite (|w| ~ 1e37, finite): its checkpoint is kept but marked
    # unhealthy (issue 31), so a rerun starts over instead of resuming it
    assert "A rerun resumes from step 0 (no healthy checkpoint)" in text
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001"]
    assert "unhealthy" in (unhealthy(out / "checkpoints" / "step_00000001") or "")


@pytest.mark.slow  # a whole training run
def test_a_run_ending_in_a_bad_streak_exits_diverged_and_ships_nothing(tmp_path, capsys):
    """Issue 31: with train.lr=1e38 the first step blows the weights up (finite), every later step is skipped,
    and the run reaches max_steps before max_bad_steps: exit 3, the divergence message, no final checkpoint, no
    hf/, no summary.json; a rerun says the same instead of shipping it."""
    out = tmp_path / "diverged"
    recipe = _recipe(out, **{"train.lr": "1e38", "train.save_every": "0", "train.max_steps": "4"})
    assert run(recipe) == 3
    text = capsys.readouterr().out
    assert "3 consecutive steps with non-finite gradients, up to its last step, 4" in text
    assert "A rerun resumes from step 0 (no healthy checkpoint)" in text
    assert not list(out.glob("checkpoints/step_*")) and not (out / "hf").exists()
    assert not (out / "summary.json").exists()
    assert run(recipe) == 3 and not (out / "hf").exists()


def test_too_little_data_for_a_global_batch_gives_the_numbers_and_the_fix(tmp_path):
    """issue 19.6: the message gives the samples, the global batch and dp, and the fix."""
    with pytest.raises(ValueError) as e:
        run(_recipe(tmp_path, **{"data.max_samples": "1", "data.val_size": "0", "train.micro_batch_size": "2",
                                 "train.grad_accum": "3"}))
    assert ("1 samples make 1 packed sequences, a global batch takes 6 (train.micro_batch_size 2 x "
            "train.grad_accum 3 x dp 1); lower train.micro_batch_size or train.grad_accum") in str(e.value)


def test_a_worker_runs_the_plans_layout_or_refuses_it_before_any_work(tmp_path, monkeypatch):
    """The plan's layout is checked against the world the worker was started in (here one process, no
    msrun), never decided again: a plan made for 2 workers stops naming both worlds and the fix."""
    from jobspec.config import ConfigError

    monkeypatch.delenv("MS_ROLE", raising=False)
    plan = load_recipe("tiny-cpu", {"output_dir": str(tmp_path / "out")}).resolved(2, "cpu")
    with pytest.raises(ConfigError, match=r"made for 2 worker\(s\) on cpu .*this job has 1 on cpu.*launcher plan"):
        run(plan)
    assert not (tmp_path / "out").exists()  # nothing was started


@pytest.mark.slow  # a whole training run's fixture
def test_a_rerun_after_a_killed_export_exports_from_the_final_checkpoint(straight, tmp_path, capsys):
    """Issue 31 item 3: the final checkpoint written, the export killed (no hf/, a stale .hf.tmp-<host>-<pid>):
    the rerun said "already finished" with no hf/. Now the rerun check sees hf/ missing, the worker resumes the
    final checkpoint, trains no step, saves nothing again and exports it; then the run is finished."""
    from jobspec.rerun import finished_already

    out = tmp_path / "run"
    shutil.copytree(straight, out)
    shutil.rmtree(out / "hf")
    final = out / "checkpoints" / "step_00000006"
    written = final.stat().st_mtime_ns
    recipe = _recipe(out, **{"train.profile_steps": "2,3"})
    assert finished_already(recipe) is None
    assert "finished at step 6 but" in capsys.readouterr().out
    assert run(recipe) == 0
    assert final.stat().st_mtime_ns == written  # the final checkpoint exported as it was, not saved again
    for name in ("model.safetensors", "config.json"):
        assert (out / "hf" / name).is_file()
    a, b = load_file(str(straight / "hf" / "model.safetensors")), load_file(str(out / "hf" / "model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert finished_already(recipe).startswith("already finished at step 6")
