"""The recipe schema itself (jobspec.config): defaults, coercion, every problem at once, the resolved layout."""
from __future__ import annotations

import dataclasses
import json

import pytest

from jobspec.config import RECIPES_DIR, ConfigError, Recipe, to_dict
from jobspec.layout import world_problems
from jobspec.recipe_load import load_recipe, resolve_recipe_path


def problems_of(**overrides) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_recipe("tiny-cpu", overrides)
    return e.value.problems


@pytest.mark.parametrize("path", sorted(RECIPES_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_recipe_loads_and_names_itself(path):
    r = load_recipe(path.stem)
    assert r.name == path.stem
    assert load_recipe(str(path)) == r  # by name or by path: the same recipe


def test_the_dataclass_defaults_are_the_defaults():
    r = load_recipe(raw={})
    assert r == Recipe() and r.layout is None  # decided by Recipe.resolved
    assert (r.train.grad_accum, r.parallel.tp, r.parallel.dp, r.parallel.shard_optimizer) == (
        Recipe().train.grad_accum, 1, 0, None)


def test_tp_is_a_number_or_auto_and_auto_is_refused_unresolved():
    assert load_recipe("tiny-cpu", {"parallel.tp": "auto"}).parallel.tp == "auto"
    assert load_recipe("tiny-cpu", {"parallel.tp": "4"}).parallel.tp == 4
    assert problems_of(**{"parallel.tp": "two"}) == [
        "parallel.tp='two': expected an integer or auto (e.g. parallel.tp=auto)"]
    assert problems_of(**{"parallel.tp": "0"}) == ["parallel.tp=0: must be >= 1 (e.g. parallel.tp=1)"]
    with pytest.raises(ConfigError, match="parallel.tp='auto': auto is resolved by the launcher first"):
        load_recipe("qwen-full").resolved(8, "npu")


def test_overrides_are_coerced_to_the_schema_types():
    r = load_recipe("tiny-cpu", {"train.lr": "3e-5", "train.max_steps": "7", "train.betas": "0.8,0.95",
                                 "parallel.shard_optimizer": "false"})
    assert (r.train.lr, r.train.max_steps, r.train.betas, r.parallel.shard_optimizer) == (
        3e-5, 7, [0.8, 0.95], False)


def test_every_problem_is_reported_at_once_each_naming_its_key_and_a_fix():
    lines = problems_of(**{"train.lr": "0", "train.schedule": "linear", "data.seq_len": "4", "parallel.pp": "2"})
    assert len(lines) == 4
    by_key = {line.split("=")[0]: line for line in lines}
    assert "must be > 0 (e.g. train.lr=2e-5)" in by_key["train.lr"]
    assert "must be one of cosine, constant (e.g. train.schedule=cosine)" in by_key["train.schedule"]
    assert "must be >= 8" in by_key["data.seq_len"]
    assert "pipeline parallelism is not supported" in by_key["parallel.pp"]


def test_an_unparsable_value_fails_its_type_only_not_its_range_too():
    lines = problems_of(**{"train.max_steps": "many"})
    assert len(lines) == 1 and lines[0].startswith("train.max_steps")


def test_an_unknown_key_lists_the_known_keys_of_its_section():
    lines = problems_of(**{"train.learning_rate": "1e-5"})
    assert len(lines) == 1 and lines[0].startswith("train.learning_rate: unknown key; known keys: ")
    assert " lr, betas, eps, weight_decay," in lines[0]


def test_a_bad_value_from_the_recipe_file_names_its_line(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("train:\n  lr: 1e-5\n  schedule: linear\n")
    with pytest.raises(ConfigError) as e:
        load_recipe(str(f))
    assert e.value.problems == [f"{f}:3: train.schedule='linear': must be one of cosine, constant "
                                "(e.g. train.schedule=cosine)"]


def test_an_unknown_recipe_name_lists_the_shipped_ones():
    with pytest.raises(ConfigError, match="no such recipe; use one of: .*tiny-cpu"):
        resolve_recipe_path("tiny-gpu")


@pytest.mark.parametrize("tp,dp,world,expect", [(2, 0, 8, 4), (1, 0, 4, 4), (2, 2, 4, 2)])
def test_resolved_derives_dp_and_the_sharded_optimizer(tp, dp, world, expect):
    asked = load_recipe("tiny-cpu", {"parallel.tp": str(tp), "parallel.dp": str(dp), "train.grad_accum": "3"})
    r = asked.resolved(world, "cpu")
    lay = r.decided_layout
    assert (lay.tp, lay.dp, lay.world, lay.device, lay.device_target) == (tp, expect, world, "cpu", "CPU")
    assert lay.shard_optimizer is (expect > 1)
    assert lay.overlap_grad_reduce is (expect > 1)
    assert lay.vocab_parallel is (tp > 1)
    assert (lay.global_batch, lay.seq_len) == (r.train.micro_batch_size * 3 * expect, r.data.seq_len)
    assert r.launch.device == "cpu"
    assert r.parallel == asked.parallel  # the request stays as asked; the decision is the layout's


def test_resolved_decides_the_layout_once_and_then_only_checks_it():
    r = load_recipe("tiny-cpu", {"parallel.tp": "2"}).resolved(4, "cpu")
    assert r.resolved(4, "cpu") == r
    # a plan's layout is kept as written, never decided again from the parallel section
    kept = dataclasses.replace(r, layout=dataclasses.replace(r.decided_layout, shard_optimizer=False))
    assert kept.resolved(4, "cpu").decided_layout.shard_optimizer is False
    with pytest.raises(ConfigError, match=r"made for 4 worker\(s\) on cpu .*this job has 2 on cpu"):
        r.resolved(2, "cpu")
    with pytest.raises(ConfigError, match="this job has 4 on npu"):
        r.resolved(4, "npu")
    with pytest.raises(ValueError, match="not resolved"):
        _ = load_recipe("tiny-cpu").decided_layout


def test_a_recipe_cannot_set_the_layout_only_the_parallel_section(tmp_path):
    with pytest.raises(ConfigError, match=r"layout: decided by the launcher .*parallel.shard_optimizer=false"):
        load_recipe("tiny-cpu", {"layout.dp": "2"})
    (tmp_path / "r.yaml").write_text("layout:\n  shard_optimizer: true\n")
    with pytest.raises(ConfigError, match="layout: decided by the launcher"):
        load_recipe(str(tmp_path / "r.yaml"))


@pytest.mark.parametrize("tp,dp,world,key,fix", [(3, 0, 4, "parallel.tp", "2"), (2, 3, 4, "parallel.dp", "2")])
def test_a_layout_that_does_not_fit_the_world_names_a_value_that_does(tp, dp, world, key, fix):
    problems = world_problems(tp, dp, 1, world)
    assert [(p.key, p.example) for p in problems] == [(key, fix)]


def test_the_resolved_recipe_round_trips_through_its_dict():
    r = load_recipe("tiny-cpu").resolved(1, "cpu")
    d = to_dict(r)
    assert load_recipe(raw=d) == r
    assert dataclasses.asdict(r) == d


def test_load_plan_reads_the_recipe_of_a_plan_a_recipe_json_or_yaml(tmp_path):
    from jobspec.finish import finished
    from jobspec.plan_reader import load_plan

    """One reader for the workers and prepare-data (they read plan.json each on their own before); a recipe no
    launcher finished comes back finished as the launcher does (jobspec/finish.py)."""
    r = finished(load_recipe("tiny-cpu").resolved(1, "cpu"))
    (tmp_path / "plan.json").write_text(json.dumps({"recipe": to_dict(r), "topology": {}}))
    (tmp_path / "recipe.json").write_text(json.dumps(to_dict(r)))
    assert load_plan(tmp_path / "plan.json") == r == load_plan(tmp_path / "recipe.json")
    assert load_plan(RECIPES_DIR / "tiny-cpu.yaml") == finished(load_recipe("tiny-cpu"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"bad.json: Expecting property name"):
        load_plan(tmp_path / "bad.json")
