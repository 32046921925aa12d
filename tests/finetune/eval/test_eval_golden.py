"""The evaluator against lm-evaluation-harness (tests/finetune/eval/golden.json, tools/make_eval_golden.py): the same
tiny model and synthetic files give the same contexts, per-request log-likelihoods within 1e-4, the same
accuracies, and for gsm8k the same greedy answers and exact-match scores."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from finetune.eval.runner import score_task
from finetune.eval.tasks import context, load_task
from jobspec.eval_config import EvalConfig
from jobspec.tiny import ensure_tiny_model
from tests.tolerances import total_rtol

HERE = Path(__file__).parent
GOLDEN = json.loads((HERE / "golden.json").read_text(encoding="utf-8"))
DATA = HERE / "data"
LL_ATOL = 1e-4  # the bound on a request's log-likelihood (sums of a few fp32 log-softmax terms)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("eval") / "model"
    m = GOLDEN["model"]
    ensure_tiny_model(d, m["overrides"], m["seed"], m["std"])
    return d


@pytest.fixture(scope="module")
def loaded(model_dir):
    from finetune.eval.report import load_scorer

    return load_scorer(str(model_dir), "cpu", chat=False)


def run(loaded, model_dir, task: str, shots: int, chat: bool, max_length: int = 4096,
        multiturn: bool = True) -> tuple[dict, list, list]:
    from finetune.eval.report import chat_renderer

    c = EvalConfig(tasks=[task], data_dir=str(DATA), num_fewshot=shots, apply_chat_template=chat, batch_size=3,
                   fewshot_as_multiturn=multiturn)
    subs = load_task(task, c)
    tokenizer_config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    scorer = dataclasses.replace(loaded, chat=chat_renderer(str(model_dir), tokenizer_config) if chat else None,
                                 max_length=max_length)
    results, records = score_task(scorer, task, subs, c, print)
    contexts = [] if task == "perplexity" else [context(s, i, scorer.chat, multiturn) for s in subs
                                                for i in range(len(s.docs))]
    return results, records, contexts


@pytest.mark.parametrize("case,task", [("zero-shot", "mmlu"), ("zero-shot", "ceval-valid"), ("two-shot", "mmlu"),
                                       ("two-shot", "ceval-valid"), ("chat", "mmlu"),
                                       ("chat-two-shot-multiturn", "mmlu"), ("chat-two-shot-one-turn", "mmlu"),
                                       ("choice-texts", "arc_easy"),
                                       ("choice-texts", "hellaswag")])
def test_multiple_choice_equals_lm_eval(loaded, model_dir, case, task):
    gold = {k: v for k, v in GOLDEN["cases"][case].items() if k == task or k.startswith(task + "_")}
    shots = 0 if case in ("zero-shot", "chat") else 2  # choice-texts: lm-eval's seeded sampler, 2 shots
    results, records, contexts = run(loaded, model_dir, task, shots, case.startswith("chat"),
                                     multiturn=case != "chat-two-shot-one-turn")  # lm-eval's fewshot_as_multiturn
    assert contexts == [c for g in gold.values() for c in g["contexts"]]
    ours = np.array([r["loglikelihoods"] for r in records])
    ref = np.array([ll for g in gold.values() for ll in g["loglikelihoods"]])
    np.testing.assert_allclose(ours, ref, rtol=0, atol=LL_ATOL)
    assert [r["is_greedy"] for r in records] == [x for g in gold.values() for x in g["is_greedy"]]
    for name, g in gold.items():
        assert results[name]["n"] == g["n"] and results[name]["num_fewshot"] == g["num_fewshot"]
        for metric, value in g["metrics"].items():  # accuracies exactly, lm-eval's stderr up to float rounding
            assert results[name][metric] == (pytest.approx(value) if metric.endswith("_stderr") else value), metric
    n = sum(g["n"] for g in gold.values())  # lm-eval's group average: weighted by size
    assert results[task]["acc"] == pytest.approx(sum(g["metrics"]["acc"] * g["n"] for g in gold.values()) / n)
    for group, metrics in GOLDEN["cases"][case].get("_groups", {}).items():  # lm-eval's group tree: pooled stderr
        assert results[group]["acc"] == metrics["acc"], group
        assert results[group]["acc_stderr"] == pytest.approx(metrics["acc_stderr"]), group


def test_gsm8k_equals_lm_eval(loaded, model_dir):
    gold = GOLDEN["cases"]["gsm8k"]["gsm8k"]
    results, records, contexts = run(loaded, model_dir, "gsm8k", -1, False)
    assert contexts == gold["contexts"]  # 5-shot from train, drawn as lm-eval's seeded sampler draws them
    assert [r["response"] for r in records] == gold["responses"]
    for metric, value in gold["metrics"].items():
        assert results["gsm8k"][metric] == value


def test_perplexity_equals_lm_eval(loaded, model_dir):
    gold = GOLDEN["cases"]["perplexity"]["perplexity"]
    max_length = 16  # tools/make_eval_golden.py's PERPLEXITY_MAX_LENGTH: each document spans several windows
    results, records, _ = run(loaded, model_dir, "perplexity", 0, False, max_length)
    assert all(r["tokens"] > max_length for r in records[:1])
    ours, ref = np.array([r["loglikelihood"] for r in records]), np.array(gold["loglikelihoods"])
    np.testing.assert_allclose(ours, ref, rtol=0, atol=LL_ATOL * max(r["tokens"] for r in records))
    rel = total_rtol(LL_ATOL, sum(r["tokens"] for r in records), sum(r["loglikelihood"] for r in records))
    for metric, value in gold["metrics"].items():  # each linear in the total log-likelihood (perplexity: its log)
        log = math.log if metric.endswith("perplexity") else float
        assert log(results["perplexity"][metric]) == pytest.approx(log(value), rel=rel), metric
