"""issue 22 §2: one RunDir; docs/training.md's output table is generated from it."""
import json
from pathlib import Path

import pytest

from jobspec.config import REPO_ROOT, ConfigError, resolved_model_dir, to_dict
from jobspec.finish import BUNDLED_TOKENIZER, finished
from jobspec.lifecycle import log_dir
from jobspec.plan_reader import load_run
from jobspec.recipe_load import load_recipe
from jobspec.rundir import ENTRIES, RunDir, is_complete, readme_table, run_dir_of


def test_the_training_page_table_is_the_rundirs():
    assert readme_table() in (REPO_ROOT / "docs" / "training.md").read_text()
    assert "(docs/training.md)" in (REPO_ROOT / "README.md").read_text()  # the README links the page


def test_every_entry_is_a_path_and_the_project_uses_them(tmp_path):
    run = RunDir(tmp_path)
    for attr, rel, _ in ENTRIES:
        path = getattr(run, attr)() if attr in ("npu_log", "lock") else getattr(run, attr)
        assert path == tmp_path / rel.split("/")[0]
    assert run.checkpoint(30) == tmp_path / "checkpoints" / "step_00000030"
    assert run.export(run.checkpoint(30)) == tmp_path / "hf-step_00000030"
    recipe = load_recipe("tiny-cpu", {"output_dir": str(tmp_path)})
    assert Path(resolved_model_dir(recipe)) == run.base_model and run_dir_of(recipe).data == run.data
    assert log_dir(tmp_path) == run.logs


def test_a_checkpoint_is_complete_with_its_manifest_and_not_as_tmp(tmp_path):
    done, tmp = tmp_path / "step_00000001", tmp_path / "step_00000002.tmp"
    for d in (done, tmp):
        d.mkdir()
        (d / "manifest.json").write_text("{}")
    assert is_complete(done) and not is_complete(tmp) and not is_complete(tmp_path / "step_00000003")


def test_the_node_locks_and_npu_logs_are_per_node(tmp_path):
    run = RunDir(tmp_path)
    assert run.lock(2) == tmp_path / ".lock.node2" and run.lock(-1) == tmp_path / ".lock.node-1"
    assert run.npu_log(1) == tmp_path / "npu-node1.jsonl"


def test_data_cache_dir_moves_the_token_cache_and_survives_plan_json(tmp_path):
    recipe = load_recipe("tiny-cpu", {"output_dir": str(tmp_path / "o"), "data.cache_dir": str(tmp_path / "c")})
    run = run_dir_of(recipe)
    assert run.data == tmp_path / "c" and run.hf == tmp_path / "o" / "hf"
    assert RunDir.from_json(json.loads(json.dumps(run.to_json()))) == run
    assert run.to_json()["checkpoints"] == str(tmp_path / "o" / "checkpoints")


def test_the_finished_recipe_carries_every_path_and_finishing_again_changes_nothing(tmp_path):
    """issue 32 item 3: model dir, token cache, tokenizer and nproc are fields of the recipe the workers read."""
    tiny = finished(load_recipe("tiny-cpu", {"output_dir": str(tmp_path)}), nproc=2)
    run = RunDir(tmp_path)
    assert (tiny.model.dir, tiny.data.cache_dir) == (str(run.base_model), str(run.data))
    assert tiny.model.tokenizer == str(BUNDLED_TOKENIZER) and tiny.launch.nproc_per_node == 2
    assert finished(tiny) == tiny and run_dir_of(tiny) == run
    given = finished(load_recipe("tiny-cpu", {"output_dir": str(tmp_path), "model.dir": "/m"}))
    assert (given.model.dir, given.model.tokenizer) == ("/m", "/m/tokenizer.json")
    assert finished(load_recipe("tiny-cpu", {"model.tokenizer": "/t.json"})).model.tokenizer == "/t.json"


def test_a_worker_reads_the_plans_run_dir_not_the_recipes(tmp_path):
    """The parent decides, the children read: plan.json's run_dir wins over a re-derivation."""
    recipe = load_recipe("tiny-cpu", {"output_dir": str(tmp_path / "o")})
    decided = RunDir(tmp_path / "o", tmp_path / "shared-cache")
    plan = {"recipe": to_dict(recipe), "run_dir": decided.to_json(), "model_hash": "0123456789abcdef"}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    read = load_run(tmp_path / "plan.json")
    assert read[1:] == (decided, "0123456789abcdef") and read.recipe.data.cache_dir == str(decided.data)
    (tmp_path / "recipe.json").write_text(json.dumps(to_dict(recipe)))  # a worker started by hand: hashes itself
    assert load_run(tmp_path / "recipe.json") == (finished(recipe), RunDir(tmp_path / "o"), "")
    (tmp_path / "plan.json").write_text(json.dumps({**plan, "model_hash": 7}))  # was silently ignored
    with pytest.raises(ConfigError, match="model_hash 7 is not a string; make the plan again"):
        load_run(tmp_path / "plan.json")
