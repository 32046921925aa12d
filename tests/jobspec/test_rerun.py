"""issue 19.3: running `make train` again in a run directory: nothing to do, continue, or refuse, before any work."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from finetune.io.checkpoint import MANIFEST
from jobspec.checkpoint_index import STATE
from jobspec.config import REPO_ROOT
from jobspec.recipe_load import load_recipe
from jobspec.rerun import RunSettingsChanged, finished_already, run_settings


def _finished_run(out, **over) -> None:
    """A run directory whose final checkpoint (step 80) was trained with the tiny-cpu recipe and ``over``."""
    ckpt = out / "checkpoints" / "step_00000080"
    ckpt.mkdir(parents=True)
    recipe = load_recipe("tiny-cpu", {"output_dir": str(out), **over})
    (ckpt / STATE).write_text(json.dumps({"step": 80, "settings": run_settings(recipe), "finished": True}))
    (ckpt / MANIFEST).write_text(json.dumps({"step": 80, "files": {}}))
    (out / "hf").mkdir()
    for name in ("config.json", "model.safetensors"):  # its export (contents not read by the rerun check)
        (out / "hf" / name).write_text("{}")
    (out / "summary.json").write_text("{}")


def test_the_same_settings_finished_longer_continues_other_refused(tmp_path):
    out = tmp_path / "run"
    _finished_run(out)
    same = load_recipe("tiny-cpu", {"output_dir": str(out)})
    assert finished_already(same) == (f"already finished at step 80 ({out / 'hf'}); nothing to do (raise "
                                      "train.max_steps or train.epochs to train on from there)")
    assert finished_already(load_recipe("tiny-cpu", {"output_dir": str(out), "train.max_steps": "120"})) is None
    assert finished_already(load_recipe("tiny-cpu", {"output_dir": str(out), "train.epochs": "3"})) is None
    assert finished_already(load_recipe("tiny-cpu", {"output_dir": str(out), "train.resume": "never",
                                                     "train.lr": "1e-5"})) is None
    with pytest.raises(RunSettingsChanged) as e:
        finished_already(load_recipe("tiny-cpu", {"output_dir": str(out), "train.lr": "1e-5",
                                                  "train.schedule": "constant", "parallel.tp": "1"}))
    msg = str(e.value)
    assert f"train.lr was {same.train.lr!r}, now 1e-05" in msg and "train.schedule was 'cosine', now 'constant'" in msg
    assert "parallel" not in msg and "OUTPUT_DIR=" in msg and "train.resume=never" in msg
    assert finished_already(load_recipe("tiny-cpu", {"output_dir": str(tmp_path / "new")})) is None


def _launcher(out, *overrides):
    env = {**os.environ, "OUTPUT_DIR": str(out), "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-m", "launcher", "train", *overrides], env=env, capture_output=True,
                          text=True, timeout=120, cwd=REPO_ROOT)


def test_the_launcher_answers_a_rerun_before_any_work(tmp_path):
    out = tmp_path / "run"
    _finished_run(out)
    before = sorted(str(p) for p in out.rglob("*"))
    r = _launcher(out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"already finished at step 80 ({out / 'hf'}); nothing to do" in r.stdout + r.stderr
    r = _launcher(out, "train.lr=1e-5")
    assert r.returncode == 2 and "train.lr was" in r.stderr and "Traceback" not in r.stderr
    assert sorted(str(p) for p in out.rglob("*")) == before  # no model, cache, plan or lock written


@pytest.mark.parametrize("over, said", [
    ({"train.method": "lora"}, "train.method was 'full', now 'lora'"),
    ({"train.micro_batch_size": "4"}, "train.micro_batch_size was 2, now 4"),
    ({"train.method": "lora", "train.max_steps": "120"}, "train.method was 'full', now 'lora'")])
def test_method_and_micro_batch_changes_are_refused_even_with_more_steps(tmp_path, over, said):
    """Issue 31 wrong answer 1 and the late answers: these were "already finished" (the same max_steps) or failed
    in the worker after 24-34 s (more steps); now refused before any work, naming old and new value and the fix."""
    out = tmp_path / "run"
    _finished_run(out)
    with pytest.raises(RunSettingsChanged) as e:
        finished_already(load_recipe("tiny-cpu", {"output_dir": str(out), **over}))
    assert said in str(e.value) and "train.resume=never" in str(e.value)


@pytest.mark.parametrize("key, value, said", [("lora.alpha", "32", "lora.alpha was 16.0, now 32.0"),
                                              ("lora.dropout", "0.2", "lora.dropout was 0.05, now 0.2"),
                                              ("lora.r", "4", "lora.r was 8, now 4")])
def test_a_lora_run_continued_with_other_lora_settings_is_refused(tmp_path, key, value, said):
    """Issue 31 wrong answer 2: lora.alpha=32 lora.dropout=0.2 train.max_steps=6 continued with the adapter's
    scale doubled mid-run; every lora.* key is a training setting of a LoRA run."""
    out = tmp_path / "run"
    _finished_run(out, **{"train.method": "lora"})
    with pytest.raises(RunSettingsChanged, match=said):
        finished_already(load_recipe("tiny-cpu", {"output_dir": str(out), "train.method": "lora", key: value,
                                                  "train.max_steps": "120"}))


@pytest.mark.parametrize("lost", ["hf/model.safetensors", "hf", "adapter/adapter_config.json", "summary.json"])
def test_finished_means_the_outputs_exist(tmp_path, lost):
    """Issue 31 item 3: a final checkpoint whose export was killed is not "finished": the rerun exports it."""
    import shutil

    out = tmp_path / "run"
    _finished_run(out, **{"train.method": "lora"})
    (out / "adapter").mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (out / "adapter" / name).write_text("{}")
    recipe = load_recipe("tiny-cpu", {"output_dir": str(out), "train.method": "lora"})
    assert finished_already(recipe) is not None
    shutil.rmtree(out / lost) if (out / lost).is_dir() else (out / lost).unlink()
    assert finished_already(recipe) is None
    # two nodes, node-local OUTPUT_DIRs: node 1 never has rank 0's export, so no node looks (all decide alike)
    local = load_recipe("tiny-cpu", {"output_dir": str(out), "train.method": "lora", "launch.nnodes": "2"})
    assert finished_already(local) is not None


def test_a_torn_weight_index_is_no_finished_export(tmp_path, capsys):
    """hf/'s sharded index cut short by a killed export, beside a stale model.safetensors: not finished (the
    index's shards are unknown, so the export is redone), never "nothing to do"."""
    out = tmp_path / "run"
    _finished_run(out)
    recipe = load_recipe("tiny-cpu", {"output_dir": str(out)})
    assert finished_already(recipe) is not None
    (out / "hf" / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-0000')
    assert finished_already(recipe) is None
    assert "model.safetensors.index.json is missing or unreadable" in capsys.readouterr().out
