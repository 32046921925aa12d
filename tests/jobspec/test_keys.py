"""Issue 32 item 4: a recipe key's facts live on its field (jobspec/keys.py); validate's ranges, the rerun's
training keys, the token cache's settings, the path keys and the env contract are derived from them. Each
derived list equals the hand-written one it replaced (captured before the change), and a new key with facts
appears in each place."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from jobspec.config import DataConfig, Recipe
from jobspec.data import cache
from jobspec.eval_config import EvalConfig, eval_problems
from jobspec.keys import cache_settings, env_keys, key, path_keys, range_problems, training_keys
from jobspec.recipe_load import load_recipe
from jobspec.recipe_parse import ConfigError
from jobspec.rerun import TRAINING_KEYS
from jobspec.validate import validate
from launcher import settings

# the hand-written lists before the facts (jobspec/rerun.py, launcher/settings.py at 288d33f)
TRAINING_BEFORE = ("train.method", "train.lr", "train.betas", "train.eps", "train.weight_decay", "train.warmup_steps",
                   "train.schedule", "train.min_lr", "train.clip_grad", "train.seed", "train.micro_batch_size",
                   "data.seq_len", "data.packing", "data.max_tokens_per_batch")
PATHS_BEFORE = {"output_dir": ("output", "output/run1"), "data.cache_dir": ("output", "output/run1/data"),
                "model.dir": ("input", "models/Qwen2.5-7B-Instruct"), "data.paths": ("input", "sft/train.jsonl"),
                "data.val_paths": ("input", "sft/val.jsonl"), "launch.hostfile": ("input", "hostfiles/two-nodes.txt"),
                "eval.data_dir": ("input", "benchmarks")}
ENV_BEFORE = {"MODEL_DIR": "model.dir", "DATA": "data.paths", "DATA_FORMAT": "data.format", "OUTPUT_DIR": "output_dir",
              "NNODES": "launch.nnodes", "NODE_RANK": "launch.node_rank", "MASTER_ADDR": "launch.master_addr",
              "MASTER_PORT": "launch.master_port", "NPROC_PER_NODE": "launch.nproc_per_node",
              "HOSTFILE": "launch.hostfile", "TP": "parallel.tp", "PP": "parallel.pp", "DP": "parallel.dp",
              "NUMA_BIND": "launch.numa_bind", "MAX_RESTARTS": "launch.max_restarts", "EVAL_TASKS": "eval.tasks",
              "EVAL_DATA": "eval.data_dir", "DRY_RUN": "launch.dry_run"}
CACHE_ALWAYS = {"system_prompt", "seq_len", "format", "max_samples", "clean"}  # and, only when set:
CACHE_WHEN_SET = {"columns": {"instruction": "q"}, "on_error": "skip", "val_size": 0.1, "val_paths": ["v.jsonl"],
                  "thinking": "drop"}


def test_each_derived_list_equals_the_hand_written_one():
    assert sorted(TRAINING_KEYS) == sorted(TRAINING_BEFORE)
    assert settings.PATH_KEYS == {**PATHS_BEFORE, "model.tokenizer": ("input", "models/Qwen2.5-7B-Instruct/"
                                                                                "tokenizer.json")}  # item 3's key
    assert settings.ENV_KEYS == ENV_BEFORE
    assert ("MASTER_PORT", "launch.master_port", "scheduler port, default 8118, same on every node") in \
        settings.ENV_CONTRACT
    assert set(cache_settings(DataConfig())) == CACHE_ALWAYS
    set_all = DataConfig(**CACHE_WHEN_SET)  # type: ignore[arg-type]
    assert cache_settings(set_all) == {**{k: getattr(set_all, k) for k in CACHE_ALWAYS - {"clean"}},
                                       "clean": dataclasses.asdict(set_all.clean), **CACHE_WHEN_SET}


def test_validate_reports_what_the_hand_written_ranges_did():
    before = json.loads((Path(__file__).parent / "validate_before_facts.json").read_text())
    with pytest.raises(ConfigError) as e:
        load_recipe("tiny-cpu", before["overrides"])
    assert sorted(e.value.problems) == before["problems"]
    assert [p.key for p in eval_problems(EvalConfig(batch_size=0, limit=-1))] == ["eval.batch_size", "eval.limit"]


@dataclasses.dataclass
class _NewData(DataConfig):
    new_knob: int = key(3, ge=1, example="3", training=True, cache="always", path="input", env="NEW_KNOB",
                        env_help="a new key, default {default}")


def test_a_new_key_with_facts_appears_in_each_derived_place():
    r = Recipe(data=_NewData(new_knob=0))
    assert "data.new_knob" in training_keys(r)
    assert cache_settings(r.data)["new_knob"] == 0
    assert path_keys(r)["data.new_knob"] == ("input", "3")
    assert env_keys(r)["NEW_KNOB"] == ("data.new_knob", "a new key, default 3")
    assert [p.text() for p in range_problems(r) if p.key == "data.new_knob"] == [
        "data.new_knob=0: must be >= 1 (e.g. data.new_knob=3)"]
    assert "data.new_knob" in {p.key for p in validate(r)}
    assert cache.settings_of(r.data, Path(__file__).parents[2] / "assets" / "tokenizer" / "tokenizer.json")[
        "new_knob"] == 0
