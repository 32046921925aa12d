"""Issue 31, the run-lifecycle rows: a rerun in a run directory is answered before any work, by the settings
(method, every lora.* key, micro batch, DATA) before "finished", and "finished" only with the outputs there.

Each case runs ``python -m launcher train`` (a CPU host, the tiny default) on a run directory whose final
checkpoint is written by hand (tests/jobspec/test_rerun.py's ``_finished_run``): the exit code, the words, no
traceback, and that nothing in OUTPUT_DIR changed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jobspec.checkpoint_index import data_id
from jobspec.config import REPO_ROOT
from jobspec.data import cache
from jobspec.fsutil import _me
from tests.jobspec.test_rerun import _finished_run


def _launcher(out, *args, command: str = "train", env: dict | None = None):
    env = {**os.environ, "OUTPUT_DIR": str(out), "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    env = {k: v for k, v in env.items() if k not in ("MODEL_DIR", "RECIPE", "OVERRIDES") or k in (env or {})}
    return subprocess.run([sys.executable, "-m", "launcher", command, *args], env=env, capture_output=True,
                          text=True, timeout=300, cwd=REPO_ROOT)


def _tree(out) -> list[str]:
    return sorted(str(p) for p in out.rglob("*"))


@pytest.mark.parametrize("run_over, over, said", [
    ({}, ["train.method=lora"], "train.method was 'full', now 'lora'"),
    ({}, ["train.micro_batch_size=4", "train.max_steps=120"], "train.micro_batch_size was 2, now 4"),
    ({"train.method": "lora"}, ["train.method=lora", "lora.alpha=32", "lora.dropout=0.2", "train.max_steps=120"],
     "lora.alpha was 16.0, now 32.0; lora.dropout was 0.05, now 0.2"),
    ({"train.method": "lora"}, ["train.method=lora", "lora.r=4"], "lora.r was 8, now 4")])
def test_a_rerun_with_other_settings_is_refused_before_finished_or_any_work(tmp_path, run_over, over, said):
    """Wrong answers 1 and 2, and the late answers (24-34 s in the worker, a CheckpointMismatch three times)."""
    out = tmp_path / "run"
    _finished_run(out, **run_over)
    before = _tree(out)
    r = _launcher(out, *over)
    assert r.returncode == 2, r.stdout + r.stderr
    assert said in r.stderr and "train.resume=never" in r.stderr and "OUTPUT_DIR=" in r.stderr
    assert "Traceback" not in r.stdout + r.stderr and "already finished" not in r.stdout
    assert _tree(out) == before


def test_a_rerun_on_other_data_is_refused_before_finished(tmp_path):
    """Wrong answer 1 (DATA): a finished run asked again with other data said "already finished"."""
    out = tmp_path / "run"
    assert _launcher(out, command="prepare-data").returncode == 0  # the tiny default's model and token cache
    _finished_run(out)
    state_file = next(out.glob("checkpoints/step_*")) / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["identity"] = {"data": data_id(cache.read_manifest(out / "data"))}
    state_file.write_text(json.dumps(state))
    assert "already finished" in _launcher(out).stdout
    data = tmp_path / "other.jsonl"
    data.write_text(json.dumps({"instruction": "Say hi", "input": "", "output": "hi"}) + "\n")
    r = _launcher(out, env={"DATA": str(data)})
    assert r.returncode == 2, r.stdout + r.stderr
    assert "trained on other data" in r.stderr and str(data) in r.stderr and "already finished" not in r.stdout


def test_every_command_removes_stale_temporary_directories_first(tmp_path):
    """Item 3: a killed export's .hf.tmp-<host>-<pid> (a whole model) and a killed prepare-data's temp dir went
    only with the next make train's work; now train (even when finished), prepare-data and export remove them at
    start; a live process's are kept."""
    out = tmp_path / "run"
    _finished_run(out)
    host = _me().rsplit("-", 1)[0]
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    live = out / f".hf.tmp-{host}-{os.getpid()}"
    for command in ("train", "prepare-data", "export"):
        stale = [out / f".hf.tmp-{host}-{pid}", out / f".data.tmp-{host}-{pid}"]
        for d in stale + [live]:
            d.mkdir(exist_ok=True)
        r = _launcher(out, *(["--checkpoint", "step_99"] if command == "export" else []), command=command)
        assert not any(d.exists() for d in stale), (command, r.stdout + r.stderr)
        assert live.is_dir()
