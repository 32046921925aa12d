"""The worker entry (finetune/worker.py) started without the launcher, and the run identity it takes
from the plan (the launcher hashed the base model once per node)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from finetune import worker
from jobspec import checkpoint_index
from jobspec.checkpoint_index import STATE
from jobspec.config import REPO_ROOT, resolved_model_dir, to_dict
from jobspec.finish import finished
from jobspec.lifecycle import LAUNCHER_PID_ENV
from jobspec.recipe_load import load_recipe
from jobspec.rerun import run_settings
from jobspec.rundir import MANIFEST, RunDir


def _finished_plan(out, model_hash="", **over):
    """plan.json of a run whose final checkpoint (step 80) is in ``out``; ``over``: the plan's settings."""
    ckpt = out / "checkpoints" / "step_00000080"
    ckpt.mkdir(parents=True)
    trained = load_recipe("tiny-cpu", {"output_dir": str(out)})
    (ckpt / STATE).write_text(json.dumps({"step": 80, "settings": run_settings(trained), "finished": True}))
    (ckpt / MANIFEST).write_text(json.dumps({"step": 80, "files": {}}))
    (out / "hf").mkdir()
    for name in ("config.json", "model.safetensors"):  # its export, there: finished (contents not read)
        (out / "hf" / name).write_text("{}")
    (out / "summary.json").write_text("{}")
    plan = out / "plan.json"
    recipe = load_recipe("tiny-cpu", {"output_dir": str(out), **over})
    plan.write_text(json.dumps({"recipe": to_dict(recipe), "model_hash": model_hash}, default=str))
    return plan


def _worker(plan):
    env = {k: v for k, v in os.environ.items() if k != LAUNCHER_PID_ENV}
    return subprocess.run([sys.executable, str(REPO_ROOT / "finetune" / "worker.py"), "--config", str(plan)],
                          env=env, capture_output=True, text=True, timeout=120)


def test_a_worker_started_by_hand_on_a_finished_run_has_nothing_to_do(tmp_path):
    p = _worker(_finished_plan(tmp_path / "run"))
    assert p.returncode == 0, p.stderr
    assert f"already finished at step 80 ({tmp_path / 'run' / 'hf'}); nothing to do" in p.stdout
    assert not (tmp_path / "run" / "logs").exists()  # no rank started


def test_a_worker_started_by_hand_with_other_settings_is_refused_in_one_message(tmp_path):
    p = _worker(_finished_plan(tmp_path / "run", **{"train.lr": "1e-5"}))
    assert p.returncode == 2 and "train.lr was" in p.stderr and "train.resume=never" in p.stderr
    assert "Traceback" not in p.stderr + p.stdout


def test_under_the_launcher_the_worker_trains_with_the_plans_model_hash(tmp_path, monkeypatch):
    """The launcher already decided (a restart after a crash in the final export must export): no shortcut."""
    plan = _finished_plan(tmp_path / "run", model_hash="0123456789abcdef")
    started = []
    monkeypatch.setenv(LAUNCHER_PID_ENV, str(os.getpid()))
    for name in ("die_with_parent", "apply_binding"):
        monkeypatch.setattr(worker, name, lambda: None)
    monkeypatch.setattr(worker, "run_rank", lambda logs, rank, fn: fn())
    monkeypatch.setattr(worker, "_train", lambda recipe, run_dir, model_hash: started.append(model_hash) or 0)
    assert worker.main(["--config", str(plan)]) == 0 and started == ["0123456789abcdef"]
    plan.write_text(json.dumps(json.loads(plan.read_text())["recipe"]))  # a recipe JSON: no hash, "" (computed)
    assert worker.main(["--config", str(plan)]) == 0 and started[1:] == [""]


def test_setup_takes_the_plans_model_hash_and_hashes_once_without_it(tmp_path, monkeypatch):
    import mindspore as ms

    from finetune.dist import init_distributed
    from finetune.run.training import setup
    from jobspec.tiny import ensure_tiny_model

    small = {"output_dir": str(tmp_path), "data.max_samples": "64", "data.seq_len": "128",
             "train.micro_batch_size": "2"}
    recipe = finished(load_recipe("tiny-cpu", small).resolved(1, "cpu"))
    ensure_tiny_model(resolved_model_dir(recipe), recipe.model.init, recipe.model.init_seed)
    rank = init_distributed(recipe.decided_layout)
    reads = []
    real = checkpoint_index.file_hash
    monkeypatch.setattr(checkpoint_index, "file_hash", lambda path: (reads.append(path), real(path))[1])
    assert setup(recipe, rank, ms.float32, RunDir(tmp_path), "0123456789abcdef").identity["model"] == "0123456789abcdef"
    assert reads == []  # the weights were loaded, not read a second time for the identity
    computed = setup(recipe, rank, ms.float32, RunDir(tmp_path)).identity["model"]  # an older plan: hashed here
    assert len(reads) == 1 and computed == checkpoint_index.model_hash(resolved_model_dir(recipe))


def test_a_worker_started_by_hand_does_the_launchers_housekeeping_on_rank_0_only(tmp_path, monkeypatch):
    """Without the launcher (no AF_LAUNCHER_PID), rank 0 removes this host's dead temporary directories and,
    with train.resume=never, moves the old checkpoints aside (jobspec.checkpoint_index.tidy, the launcher's own
    step); another rank, or a worker under the launcher, leaves them."""
    from jobspec.fsutil import _me

    out = tmp_path / "run"
    (out / "checkpoints" / "step_00000010").mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = out / f".hf.tmp-{_me().rsplit('-', 1)[0]}-{dead.pid}"
    stale.mkdir()
    plan = out / "plan.json"
    plan.write_text(json.dumps({"recipe": to_dict(load_recipe("tiny-cpu", {"output_dir": str(out),
                                                                          "train.resume": "never"}))}))
    for name in ("die_with_parent", "apply_binding"):
        monkeypatch.setattr(worker, name, lambda: None)
    monkeypatch.setattr(worker, "run_rank", lambda logs, rank, fn: fn())
    monkeypatch.setattr(worker, "_train", lambda recipe, run_dir, model_hash: 0)
    monkeypatch.setenv(LAUNCHER_PID_ENV, str(os.getpid()))
    monkeypatch.setenv("RANK_ID", "0")
    assert worker.main(["--config", str(plan)]) == 0 and stale.exists()  # the launcher's to do
    monkeypatch.delenv(LAUNCHER_PID_ENV)
    monkeypatch.setenv("RANK_ID", "1")
    assert worker.main(["--config", str(plan)]) == 0 and stale.exists()  # rank 0's to do
    monkeypatch.setenv("RANK_ID", "0")
    assert worker.main(["--config", str(plan)]) == 0
    assert not stale.exists() and not (out / "checkpoints").exists() and list(out.glob("checkpoints.old-*"))


@pytest.mark.parametrize("target,blocking", [("CPU", True), ("Ascend", False)])
def test_kernels_run_when_called_on_cpu_only(monkeypatch, target, blocking):
    """dist.set_device: CPU kernels run when called (PyNative's dispatch threads spin on the cores that compute,
    docs/speed.md); an NPU keeps MindSpore's asynchronous launch, which overlaps the host with the device."""
    import mindspore as ms

    from finetune.dist import set_device

    calls = []
    monkeypatch.setattr(ms, "set_device", lambda t, i=None: calls.append(("set_device", t, i)))
    monkeypatch.setattr(ms.runtime, "launch_blocking", lambda: calls.append(("launch_blocking",)))
    set_device(target, 0)
    assert calls == [("set_device", target, 0)] + ([("launch_blocking",)] if blocking else [])

