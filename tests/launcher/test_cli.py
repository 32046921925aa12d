"""The command line: one subcommand each with its own help, variables on the CLI, where output goes."""
from __future__ import annotations

import json
import os
import re

import pytest
from launcher_fakes import make_sys

import launcher.__main__ as lm
from jobspec.config import REPO_ROOT
from jobspec.rundir import RunDir


def cpu_host(tmp_path, env=None, **kw) -> lm.Host:
    (tmp_path / "dev").mkdir(exist_ok=True)
    return lm.Host(env=env or {}, dev_dir=tmp_path / "dev", root=tmp_path, npu_smi=None,
                   sys_root=make_sys(tmp_path, {0: "0-3"}, cpuset_v2="0-3"), **kw)


def test_no_command_prints_the_overview_with_every_command_and_the_env_contract(capsys):
    assert lm.main([]) == 2
    out = capsys.readouterr().out
    assert "usage: ascend-finetune" in out and "overrides are required" not in out
    for name in lm.COMMANDS:
        assert name in out
    assert "MODEL_DIR" in out and "model.dir" in out


@pytest.mark.parametrize("command,own", [("plan", "--json"), ("train", "key=value"), ("preflight", "key=value"),
                                         ("prepare-data", "key=value")])
def test_each_command_has_its_own_help(command, own, capsys):
    with pytest.raises(SystemExit) as e:
        lm.main([command, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and f"usage: ascend-finetune {command}" in out and own in out


def test_render_help_is_renders_own(capsys):
    assert lm.main(["render", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--nodes" in out and "--pvc" in out and "key=value" in out


def test_generate_help_is_generates_own(monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr(lm.subprocess, "call", lambda argv: seen.setdefault("argv", argv) and 0)
    assert lm.main(["generate", "-h"]) == 0
    assert seen["argv"][1:] == [str(lm.GENERATE), "--help"]


def test_unknown_option_names_it(capsys):
    with pytest.raises(SystemExit) as e:
        lm.main(["plan", "--bogus"])
    assert e.value.code == 2 and "--bogus" in capsys.readouterr().err


def test_recipe_and_other_variables_on_the_command_line(tmp_path, capsys):
    host = cpu_host(tmp_path, env={"RECIPE": "nope"})
    rc = lm.main(["plan", "--json", "RECIPE=tiny-cpu", "TP=1", f"OUTPUT_DIR={tmp_path}/o", "train.lr=1e-3"], host)
    plan = json.loads(capsys.readouterr().out)
    assert rc == 0 and plan["recipe"]["name"] == "tiny-cpu" and plan["recipe"]["train"]["lr"] == 1e-3
    assert plan["sources"]["recipe"] == "tiny-cpu (RECIPE is set)"


def test_relative_output_resolves_against_the_current_directory_and_the_plan_says_why(tmp_path, capsys):
    """The default ./output lands where the command runs, even when the checkout has an output/ dir."""
    here = tmp_path / "here"
    here.mkdir()
    rc = lm.main(["plan", "--json"], cpu_host(tmp_path, cwd=here))
    plan = json.loads(capsys.readouterr().out)
    assert rc == 0 and plan["recipe"]["output_dir"] == str(here / "output")
    assert (here / "output" / "plan.json").is_file()
    # the run's paths are decided here, for the workers to read (issue 22 §2); the recipe names the same cache
    assert RunDir.from_json(plan["run_dir"]) == RunDir(here / "output")
    assert plan["recipe"]["data"]["cache_dir"] == plan["run_dir"]["data"] == str(here / "output" / "data")
    why = plan["sources"]["output_dir"]
    assert why.startswith(f"{here / 'output'}: output_dir='./output' from the recipe tiny-cpu") and str(here) in why
    rc = lm.main(["plan", "--json", "OUTPUT_DIR=rel/o"], cpu_host(tmp_path, cwd=here))
    plan = json.loads(capsys.readouterr().out)
    assert plan["recipe"]["output_dir"] == str(here / "rel/o") and "from OUTPUT_DIR" in plan["sources"]["output_dir"]
    assert not (REPO_ROOT / "rel").exists()


def test_plan_json_is_the_json_alone(tmp_path, capsys):
    assert lm.main(["plan", "--json", f"OUTPUT_DIR={tmp_path}/o"], cpu_host(tmp_path)) == 0
    out = capsys.readouterr().out
    assert out.lstrip().startswith("{") and json.loads(out)["topology"]["world_size"] == 1


def test_a_problem_from_a_recipe_line_names_the_file_and_line(tmp_path, capsys):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("train:\n  lr: fast\n  epochs: 0\ndata:\n  seq_len: 512\n")
    rc = lm.main(["plan", "--recipe", str(recipe), "train.warmup_steps=-1"],
                 cpu_host(tmp_path, env={"OUTPUT_DIR": str(tmp_path / "o")}))
    err = capsys.readouterr().err
    assert rc == 2
    assert f"{recipe}:2: train.lr='fast': expected a finite number (e.g. train.lr=2e-5)" in err
    assert f"{recipe}:3: train.epochs=0: must be >= 1 (e.g. train.epochs=1)" in err
    assert re.search(r"^  - train.warmup_steps=-1: must be >= 0", err, re.M)  # from the command line: no file


def test_every_declared_make_target_has_a_rule_and_each_command_a_target():
    text = (REPO_ROOT / "Makefile").read_text()
    phony = {t for line in re.findall(r"^\.PHONY:(.*)$", text, re.M) for t in line.split()}
    rules = set(re.findall(r"^([\w-]+):", text, re.M))
    assert phony <= rules, f"declared without a rule: {sorted(phony - rules)}"
    assert set(lm.COMMANDS) <= rules


def test_plan_leaves_a_running_jobs_plan_alone(tmp_path, capsys):
    """A job's restarts read its plan.json: plan prints, but does not overwrite it while the job holds the lock."""
    from launcher import lock

    out = tmp_path / "o"
    out.mkdir()
    (out / "plan.json").write_text('{"running": true}')
    fd = lock.acquire(out)
    try:
        assert lm.main(["plan", "--json", f"OUTPUT_DIR={out}"], cpu_host(tmp_path)) == 0
    finally:
        lock.release(fd)
    res = capsys.readouterr()
    assert json.loads(res.out)["topology"]["world_size"] == 1
    assert "plan.json not written: OUTPUT_DIR" in res.err and f"pid {os.getpid()}" in res.err
    assert (out / "plan.json").read_text() == '{"running": true}'


def test_the_console_command_is_the_launcher():
    """`ascend-finetune` (installed into .venv by make and into the image) runs console_main."""
    import importlib

    import tomllib

    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, func = scripts["ascend-finetune"].split(":")
    assert getattr(importlib.import_module(module), func) is lm.console_main


# the README and the pages its sections moved to (issue 43 item 5)
FROM_README = ("README.md", *(f"docs/{name}.md" for name in (
    "training", "checking", "evaluation", "monitoring", "datasets", "recipes", "layout", "sizes", "reliability",
    "tests", "container", "running", "environment")))


def test_readme_commands_work_from_a_fresh_clone():
    """No line of the README or of the pages its sections moved to runs `python -m launcher` (it needs the venv
    active): make, or .venv/bin/ascend-finetune."""
    for name in FROM_README:
        text = (REPO_ROOT / name).read_text()
        assert "python -m launcher" not in text.replace("`python -m launcher` run the same", ""), name
    assert ".venv/bin/ascend-finetune generate --prompt" in (REPO_ROOT / "docs" / "checking.md").read_text()
