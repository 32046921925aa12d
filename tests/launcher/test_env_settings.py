"""Env + CLI -> recipe: precedence, the default recipe, all problems at once with the variable named."""
from __future__ import annotations

import pytest
import yaml

from jobspec.config import RECIPES_DIR, ConfigError
from launcher import settings


def load(env, cli=(), recipe=None, has_npu=False):
    return settings.load(settings.collect(env, list(cli), recipe, has_npu))


def test_precedence_cli_over_env_over_recipe():
    r = load({"OVERRIDES": "train.lr=1e-4 train.epochs=2", "TP": "1"}, ["train.lr=5e-5"])
    assert r.train.lr == 5e-5  # CLI beats OVERRIDES
    assert r.train.epochs == 2  # OVERRIDES beats the recipe
    recipe_steps = yaml.safe_load((RECIPES_DIR / "tiny-cpu.yaml").read_text())["train"]["max_steps"]
    assert r.train.max_steps == recipe_steps != 0  # recipe (tiny-cpu) beats the schema default (0)
    assert r.train.weight_decay == 0.01  # schema default
    r = load({"TP": "1", "OVERRIDES": "parallel.tp=2"}, ["parallel.tp=1"])
    assert r.parallel.tp == 1


def test_env_vars_map_to_recipe_keys(tmp_path):
    env = {"MODEL_DIR": str(tmp_path), "DATA": "a.json,b.jsonl", "DATA_FORMAT": "sharegpt", "OUTPUT_DIR": "/o",
           "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "9000",
           "NPROC_PER_NODE": "8", "TP": "2", "DP": "8", "NUMA_BIND": "affinity", "MAX_RESTARTS": "3",
           "DRY_RUN": "1"}
    r = load(env)
    assert (r.model.dir, r.data.paths, r.data.format, r.output_dir) == (str(tmp_path), ["a.json", "b.jsonl"],
                                                                         "sharegpt", "/o")
    L = r.launch
    assert (L.nnodes, L.node_rank, L.master_addr, L.master_port, L.nproc_per_node) == (2, 1, "10.0.0.1", 9000, 8)
    assert (r.parallel.tp, r.parallel.dp, L.numa_bind, L.max_restarts, L.dry_run) == (2, 8, "affinity", 3, True)


def test_empty_env_values_count_as_unset():
    r = load({"TP": "", "MODEL_DIR": "  ", "MASTER_PORT": ""})
    assert r.parallel.tp == 1 and r.model.dir == "" and r.launch.master_port == 8118


def test_all_problems_reported_at_once_naming_env_vars():
    with pytest.raises(ConfigError) as e:
        load({"TP": "two", "NUMA_BIND": "sometimes", "DRY_RUN": "maybe", "OVERRIDES": "train.lrr=1 oops"},
             ["train.epochs=0"])
    p = e.value.problems
    assert "TP='two' (parallel.tp): expected an integer or auto (e.g. TP=auto)" in p
    assert any(x.startswith("NUMA_BIND='sometimes' (launch.numa_bind): must be one of auto") for x in p)
    assert any(x.startswith("DRY_RUN='maybe' (launch.dry_run): expected true or false") for x in p)
    assert any("train.lrr: unknown key; did you mean train.lr?" in x and x.startswith("OVERRIDES") for x in p)
    assert any("'oops': expected key=value" in x for x in p)
    assert any(x.startswith("train.epochs=0: must be >= 1") for x in p)
    assert sum("parallel.tp" in x for x in p) == 1  # one problem per key, not a cascade


@pytest.mark.parametrize("env,has_npu,expected", [
    ({}, False, "tiny-cpu"),
    ({"MODEL_DIR": "/m", "DATA": "/d"}, False, "tiny-cpu"),
    ({}, True, "tiny-cpu"),
    ({"MODEL_DIR": "/m"}, True, "tiny-cpu"),
    ({"MODEL_DIR": "/m", "DATA": "/d"}, True, "qwen2.5-7b-full"),
    ({"RECIPE": "tiny-cpu", "MODEL_DIR": "/m", "DATA": "/d"}, True, "tiny-cpu"),
])
def test_default_recipe(env, has_npu, expected):
    assert settings.collect(env, [], None, has_npu).recipe == expected


def test_cli_recipe_beats_env_recipe():
    assert settings.collect({"RECIPE": "qwen2.5-7b-full"}, [], "tiny-cpu").recipe == "tiny-cpu"


def test_unknown_recipe_names_the_choices():
    with pytest.raises(ConfigError, match="RECIPE='nope': no such recipe; use one of: qwen-full, qwen-lora, "
                                          "qwen2.5-7b-full, qwen2.5-7b-lora, tiny-cpu, tiny-cpu-lora"):
        load({"RECIPE": "nope"})


def test_cli_takes_variable_names_too():
    r = load({"TP": "2"}, ["TP=1", "NUMA_BIND=off"])
    assert r.parallel.tp == 1 and r.launch.numa_bind == "off"
    with pytest.raises(ConfigError, match=r"PP='x' \(parallel.pp\): expected an integer"):
        load({}, ["PP=x"])


def test_the_environment_page_table_is_the_contract_table():
    page = (RECIPES_DIR.parent / "docs" / "environment.md").read_text()
    assert settings.env_table() in page, "regenerate docs/environment.md's table from launcher.settings.env_table()"
    for var in settings.ENV_KEYS:
        assert f"`{var}`" in page
    assert "(docs/environment.md)" in (RECIPES_DIR.parent / "README.md").read_text()  # the README links the page


@pytest.mark.parametrize("env,cli,fmt", [
    ({}, [], "alpaca"),  # the recipe's own paths keep the recipe's format
    ({"DATA": "/d/sharegpt.json"}, [], "auto"),  # a user's data: detected
    ({"DATA": "/d/x.json", "DATA_FORMAT": "sharegpt"}, [], "sharegpt"),
    ({}, ["DATA=/d/x.json"], "auto"),
    ({}, ["data.paths=/d/x.json"], "auto"),
    ({"DATA": "/d/x.json", "OVERRIDES": "data.format=alpaca"}, [], "alpaca"),
])
def test_data_format_is_auto_whenever_data_is_given(env, cli, fmt):
    assert load(env, cli).data.format == fmt  # tiny-cpu says format: alpaca for its bundled files


def test_problems_come_structured_and_are_worded_by_origin():
    with pytest.raises(ConfigError) as e:
        load({"TP": "two", "OVERRIDES": "train.eps=-1"}, ["train.lr=inf"])
    items = {p.key: p for p in e.value.items}
    assert (items["parallel.tp"].message, items["parallel.tp"].example) == ("expected an integer or auto", "auto")
    assert "OVERRIDES: train.eps=-1.0: must be > 0 (e.g. train.eps=1e-6)" in e.value.problems
    assert "train.lr='inf': expected a finite number (e.g. train.lr=2e-5)" in e.value.problems


def test_compiled_layers_are_refused_where_they_were_not_shown_equal():
    def refusals(env, world=None, device="cpu"):
        with pytest.raises(ConfigError) as e:
            r = load(env)
            if world:
                r.resolved(world, device)
        return [x for x in e.value.problems if "train.compile_layers=true: not with " in x]

    given = refusals({"TP": "2", "OVERRIDES": "train.compile_layers=true train.recompute=true "
                                              "data.max_tokens_per_batch=4096 train.precision=fp16"})
    assert len(given) == 3 and all(x.endswith("(e.g. train.compile_layers=false)") for x in given)
    for what, x in zip(("train.recompute=true", "parallel.tp=2", "data.max_tokens_per_batch=4096"), given):
        assert f"not with {what}" in x
    # shown equal with data parallelism, the sharded optimizer and fp16 masters (their weights written in place)
    compiled = {"OVERRIDES": "train.compile_layers=true"}
    assert load(compiled).resolved(2, "cpu").train.compile_layers is True
    assert load({"OVERRIDES": "train.compile_layers=true train.precision=fp16"}).resolved(1, "cpu").train.compile_layers
    # known only once resolved: the device
    auto = {"OVERRIDES": "train.compile_layers=true train.precision=auto launch.device=auto"}
    assert [x.split(": ")[1] for x in refusals(auto, 1, "npu")] == ["not with launch.device=npu"]


def test_compiled_layers_default_to_on_where_nothing_refuses_them_and_the_plan_says_why():
    """train.compile_layers unset (auto): on for the CPU default, with DP and fp16; off with recompute, with
    on NPUs, each time naming the reason (compile_layers_choice, the plan's line)."""
    from jobspec.config import compile_layers_choice

    def decided(env, world=1, device="cpu"):
        r = load(env)
        asked = r.train.compile_layers
        r = r.resolved(world, device)
        return r.train.compile_layers, compile_layers_choice(r, asked)

    assert load({}).train.compile_layers is None
    assert decided({}) == (True, "on: each decoder layer one graph, compiled at the first step (auto)")
    assert decided({"OVERRIDES": "train.precision=fp16"}, 2)[0] is True
    assert decided({"OVERRIDES": "train.compile_layers=false"}) == (
        False, "off (train.compile_layers=false): each layer op by op")
    assert decided({"OVERRIDES": "train.recompute=true"}) == (
        False, "off (auto): train.recompute=true: recompute runs each layer op by op")
    assert decided({"RECIPE": "tiny-cpu-lora"})[0] is True  # dropout 0.05: masks drawn ahead (LoraAdapter.draw)
    assert decided({"OVERRIDES": "train.compile_layers=auto train.precision=auto launch.device=auto"}, 1, "npu")[1] \
        == ("off (auto): launch.device=npu: the fused attention's spec is host data per batch; graphs there are "
            "not measured")


def test_overrides_values_with_spaces_and_empty_values():
    s = settings.collect({"OVERRIDES": 'data.system_prompt="You are a pirate" export.check_prompts="" train.lr=1e-5'},
                         [], None)
    assert s.overrides == {"data.system_prompt": "You are a pirate", "export.check_prompts": "", "train.lr": "1e-5"}
    r = settings.load(s)
    assert (r.data.system_prompt, r.export.check_prompts) == ("You are a pirate", "")


def test_quotes_inside_a_value_stay():
    items, problems = settings.split_overrides('data.columns={"instruction":"prompt"} a.b=\'x y\' c.d="x=y z"')
    assert items == ['data.columns={"instruction":"prompt"}', "a.b=x y", "c.d=x=y z"] and not problems


def test_dp_sums_go_through_shared_memory_for_cpu_workers_on_one_node_and_the_plan_says_why():
    """parallel.host_collectives unset (auto): on for CPU workers with DP on one node; off (each time with the
    reason) with one DP rank, NPUs or several nodes; true where it cannot run is refused."""
    from jobspec.layout import host_collectives_choice

    def decided(env, world=2, device="cpu"):
        r = load(env).resolved(world, device)
        return r.decided_layout.host_collectives, host_collectives_choice(r.parallel.host_collectives, r.decided_layout,
                                                                           r.launch.nnodes)

    assert decided({}) == (True, "on: DP sums through shared memory (/dev/shm), not MindSpore's CPU collectives "
                                 "(auto)")
    assert decided({}, 1) == (False, "off (auto): one DP rank: nothing to sum")
    assert decided({"OVERRIDES": "parallel.host_collectives=false"}) == (False, "off (parallel.host_collectives=false)")
    assert decided({"OVERRIDES": "launch.nnodes=2"}, 4) == (False,
                                                           "off (auto): launch.nnodes=2: a DP group spans nodes")
    assert decided({"OVERRIDES": "launch.device=auto train.precision=auto"}, 2, "npu")[1] == (
        "off (auto): launch.device=npu: HCCL moves DP traffic between the NPUs")
    with pytest.raises(ConfigError) as e:
        load({"OVERRIDES": "parallel.host_collectives=true launch.nnodes=2"}).resolved(4, "cpu")
    assert ("parallel.host_collectives=true: not with launch.nnodes=2: a DP group spans nodes (e.g. "
            "parallel.host_collectives=false)") in e.value.problems
