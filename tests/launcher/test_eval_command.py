"""``ascend-finetune eval`` (make eval): the evaluator's command line from the recipe's eval section, the run's base
model beside its export, refusals before any model loads, and a whole run on the tiny model."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from launcher_fakes import make_sys

import launcher.__main__ as lm
from jobspec.config import REPO_ROOT
from jobspec.tiny import ensure_tiny_model
from launcher import evaluate

DATA = REPO_ROOT / "tests" / "finetune" / "eval" / "data"
TINY = {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "tie_word_embeddings": True}  # recipes/tiny-cpu.yaml's model.init


def cpu_host(tmp_path) -> lm.Host:
    (tmp_path / "dev").mkdir(exist_ok=True)
    return lm.Host(env={}, dev_dir=tmp_path / "dev", root=tmp_path, npu_smi=None,
                   sys_root=make_sys(tmp_path, {0: "0-3"}, cpuset_v2="0-3"))


def test_eval_without_benchmark_folder_names_eval_data(tmp_path, capsys):
    assert lm.main(["eval", f"OUTPUT_DIR={tmp_path}/o"], cpu_host(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "eval.data_dir (EVAL_DATA) is not set" in err and "Traceback" not in err


def test_eval_runs_the_tool_on_base_and_export_with_the_recipes_settings(tmp_path, monkeypatch):
    out = tmp_path / "o"
    (out / "hf").mkdir(parents=True)
    (out / "hf" / "config.json").write_text("{}")
    seen = {}
    monkeypatch.setattr(evaluate.subprocess, "call", lambda argv, env: seen.setdefault("argv", argv) and 0)
    rc = lm.main(["eval", f"OUTPUT_DIR={out}", f"EVAL_DATA={DATA}", "EVAL_TASKS=mmlu,gsm8k", "eval.limit=3",
                  "eval.apply_chat_template=true"], cpu_host(tmp_path))
    argv = seen["argv"]
    assert rc == 0 and argv[1] == str(evaluate.TOOL)
    opts = dict(zip(argv[2::2], argv[3::2]))
    assert opts["--tasks"] == "mmlu,gsm8k" and opts["--limit"] == "3" and opts["--data-dir"] == str(DATA)
    assert "--apply-chat-template" in argv and opts["--out"] == str(out / "eval")
    assert [a for a in argv if a.startswith(("base=", "hf="))] == [f"base={out / 'base-model'}", f"hf={out / 'hf'}"]


def test_a_file_of_another_layout_is_refused_before_any_model_loads(tmp_path):
    data = tmp_path / "bench"
    shutil.copytree(DATA / "ceval-valid", data / "ceval-valid")
    (data / "ceval-valid" / "val" / "accountant_val.csv").write_text("id,question,A,B,answer\n1,q,a,b,A\n")
    r = subprocess.run([sys.executable, str(evaluate.TOOL), "--model", f"base={tmp_path / 'none'}", "--data-dir",
                        str(data), "--out", str(tmp_path / "eval")], capture_output=True, text=True, cwd=REPO_ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "accountant_val.csv: no column(s) C, D; expected columns question, A, B, C, D, answer" in r.stderr
    assert "loading" not in r.stdout and not (tmp_path / "eval").exists()


@pytest.mark.slow
def test_make_eval_on_the_embedded_defaults_output(tmp_path, capfd):
    out = tmp_path / "o"
    ensure_tiny_model(out / "base-model", TINY, seed=0)
    ensure_tiny_model(out / "hf", TINY, seed=1)  # stands in for the fine-tune's export
    (out / "summary.json").write_text(json.dumps({"final_loss": 1.0}))
    rc = lm.main(["eval", f"OUTPUT_DIR={out}", f"EVAL_DATA={DATA}", "EVAL_TASKS=mmlu,ceval-valid_accountant",
                  "eval.limit=2"], cpu_host(tmp_path))
    assert rc == 0
    base, hf = (json.loads((out / "eval" / f"{m}.json").read_text()) for m in ("base", "hf"))
    assert base["results"]["mmlu"]["n"] == 4 and base["results"]["mmlu_stem"]["n"] == 4
    assert base["results"]["ceval-valid_accountant"]["n"] == 2 and hf["settings"]["limit"] == 2
    samples = [json.loads(line) for line in (out / "eval" / "samples_mmlu.jsonl").read_text().splitlines()]
    assert [s["model"] for s in samples] == ["base"] * 4 + ["hf"] * 4 and len(samples[0]["loglikelihoods"]) == 4
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_loss"] == 1.0
    rows = {(r["task"], r["metric"]): r for r in summary["eval"]["table"]}
    assert rows[("mmlu", "acc")]["delta"] == pytest.approx(rows[("mmlu", "acc")]["hf"] - rows[("mmlu", "acc")]["base"])
    assert set(rows) == {("mmlu", "acc"), ("mmlu_stem", "acc"), ("ceval-valid_accountant", "acc"),
                         ("ceval-valid_accountant", "acc_norm")}
    assert {p.name for p in (out / "eval" / "tensorboard").iterdir()} == {"base", "hf"}
    capfd.readouterr()
    assert lm.main(["eval", f"OUTPUT_DIR={out}", f"EVAL_DATA={DATA}", "EVAL_TASKS=mmlu,ceval-valid_accountant",
                    "eval.limit=2"], cpu_host(tmp_path)) == 0  # again: the base model's results are reused
    assert "[eval] base: the results of" in capfd.readouterr().out
    assert json.loads((out / "eval" / "base.json").read_text()) == base
    samples = [json.loads(line) for line in (out / "eval" / "samples_mmlu.jsonl").read_text().splitlines()]
    assert [s["model"] for s in samples] == ["base"] * 4 + ["hf"] * 4


def test_after_training_scores_only_a_successful_run_on_node_0(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from jobspec.recipe_load import load_recipe

    calls = []
    monkeypatch.setattr(evaluate, "cmd_eval", lambda job: calls.append(job.recipe.output_dir) or 0)
    on = load_recipe("tiny-cpu", {"eval.after_training": "true", "eval.data_dir": str(DATA)})
    for rc, recipe, node, expected in ((0, on, 0, 1), (3, on, 0, 0), (0, on, 1, 0),
                                       (0, load_recipe("tiny-cpu"), 0, 0)):
        calls.clear()
        recipe.launch.node_rank = node
        run = evaluate.after_training(lambda job, args, host, rc=rc: rc)
        assert run(SimpleNamespace(recipe=recipe, env={}), None, None) == rc and len(calls) == expected


def test_after_training_needs_the_benchmark_folder():
    from jobspec.config import ConfigError
    from jobspec.recipe_load import load_recipe

    with pytest.raises(ConfigError, match="eval.data_dir"):
        load_recipe("tiny-cpu", {"eval.after_training": "true"})


def test_eval_on_several_workers_runs_under_msrun(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from jobspec.recipe_load import load_recipe

    seen = {}
    monkeypatch.setattr(evaluate.subprocess, "call", lambda argv, env: seen.setdefault("argv", argv) and 0)
    recipe = load_recipe("tiny-cpu", {"eval.data_dir": str(DATA), "output_dir": str(tmp_path), "parallel.tp": "2"})
    assert evaluate.cmd_eval(SimpleNamespace(recipe=recipe, env={}, world=2, nproc=2)) == 0
    argv = seen["argv"]
    assert argv[0].endswith("msrun") and argv[argv.index("--worker_num") + 1] == "2" and "--config" not in argv
    tail = argv[argv.index(str(evaluate.TOOL)) + 1:]
    assert tail == evaluate.eval_argv(recipe, evaluate.models_of(recipe))[2:]  # every option, none cut
    assert tail[tail.index("--tp") + 1] == "2"  # the plan's TP layout
