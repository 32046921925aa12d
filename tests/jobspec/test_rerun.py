"""issue 19.3: running `make train` again in a run directory: nothing to do, continue, or refuse, before any work."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from finetune.checkpoint import MANIFEST
from jobspec.checkpoints import STATE
from jobspec.config import REPO_ROOT, load_recipe
from jobspec.rerun import RunSettingsChanged, finished_already, run_settings


def _finished_run(out, **over) -> None:
    """A run directory whose final checkpoint (step 80) was trained with the tiny-cpu recipe and ``over``."""
    ckpt = out / "checkpoints" / "step_00000080"
    ckpt.mkdir(parents=True)
    recipe = load_recipe("tiny-cpu", {"output_dir": str(out), **over})
    (ckpt / STATE).write_text(json.dumps({"step": 80, "settings": run_settings(recipe), "finished": True}))
    (ckpt / MANIFEST).write_text(json.dumps({"step": 80, "files": {}}))


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
