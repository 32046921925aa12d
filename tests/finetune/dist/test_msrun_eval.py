"""The evaluator under msrun with 2 CPU workers (each a share of the documents, results gathered) gives the
one-process numbers: the same documents, log-likelihoods within the issue's 1e-4, the same accuracies,
generated answers and perplexities; so do 2 TP ranks sharing one model."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import harness
import numpy as np
import pytest

from jobspec.config import REPO_ROOT
from jobspec.tiny import ensure_tiny_model
from tests.tolerances import total_rtol

DATA = REPO_ROOT / "tests" / "finetune" / "eval" / "data"
TOOL = REPO_ROOT / "finetune" / "eval" / "__main__.py"
LL_ATOL = 1e-4  # the bound on a request's log-likelihood
GOLDEN_MODEL = json.loads((REPO_ROOT / "tests" / "finetune" / "eval" / "golden.json").read_text())["model"]


def samples(out: Path, task: str) -> list[dict]:
    return [json.loads(line) for line in (out / f"samples_{task}.jsonl").read_text().splitlines()]


def assert_same_results(one: Path, other: Path, tasks: tuple[str, ...]) -> None:
    """``other``'s results are ``one``'s: the same accuracies and answers, log-likelihoods within 1e-4."""
    a, b = (json.loads((d / "base.json").read_text())["results"] for d in (one, other))
    assert a.keys() == b.keys()
    for name, r in a.items():
        for metric, value in r.items():
            if metric.startswith(("acc", "exact_match")) or metric in ("n", "num_fewshot"):
                assert b[name][metric] == value, (name, metric)
    if "perplexity" in a:  # each metric linear in the total log-likelihood (perplexity: its log), tokens within 1e-4
        docs = samples(one, "perplexity")
        rel = total_rtol(LL_ATOL, sum(d["tokens"] for d in docs), sum(d["loglikelihood"] for d in docs))
        for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
            log = math.log if metric.endswith("perplexity") else float
            assert log(b["perplexity"][metric]) == pytest.approx(log(a["perplexity"][metric]), rel=rel), metric
    for task in tasks:
        x, y = samples(one, task), samples(other, task)
        assert [(s["subtask"], s["doc_id"]) for s in x] == [(s["subtask"], s["doc_id"]) for s in y]
        if task == "gsm8k":
            assert [s["response"] for s in y] == [s["response"] for s in x]
        else:
            np.testing.assert_allclose([s["loglikelihoods"] for s in y], [s["loglikelihoods"] for s in x], rtol=0,
                                       atol=LL_ATOL)
    assert not list(other.glob(".dp-*"))  # the ranks' exchange files are gone


def one_and_msrun(tmp_path: Path, args: list[str], msrun_args: list[str]) -> tuple[Path, Path]:
    """The results folders of one process and of 2 msrun workers (``msrun_args`` added) on the golden model."""
    model = tmp_path / "model"
    ensure_tiny_model(model, GOLDEN_MODEL["overrides"], GOLDEN_MODEL["seed"], GOLDEN_MODEL["std"])
    args = ["--model", f"base={model}", "--data-dir", str(DATA), *args, "--device", "cpu"]
    subprocess.run([sys.executable, str(TOOL), *args, "--out", str(tmp_path / "one")], check=True, cwd=REPO_ROOT,
                   timeout=900)
    harness.msrun(TOOL, [*args, *msrun_args, "--out", str(tmp_path / "msrun")], 2, tmp_path)
    return tmp_path / "one", tmp_path / "msrun"


@pytest.mark.slow
def test_dp2_under_msrun_equals_one_process(tmp_path):
    one, dp = one_and_msrun(tmp_path, ["--tasks", "mmlu,ceval-valid,gsm8k,perplexity", "--num-fewshot", "1",
                                       "--max-gen-toks", "12", "--batch-size", "2"], [])
    assert "on 2 ranks (TP 1 x DP 2)" in (tmp_path / "msrun-logs-0" / "worker_0.log").read_text(errors="replace")
    assert "mmlu_stem" in json.loads((one / "base.json").read_text())["results"]
    assert_same_results(one, dp, ("mmlu", "ceval-valid", "gsm8k"))


@pytest.mark.slow
def test_tp2_under_msrun_equals_one_process(tmp_path):
    """Each rank holds half of every layer (the plan's TP layout, as training splits it); both score every request."""
    one, tp = one_and_msrun(tmp_path, ["--tasks", "mmlu,gsm8k", "--num-fewshot", "1", "--max-gen-toks", "12",
                                       "--batch-size", "2"], ["--tp", "2"])
    assert "on 2 ranks (TP 2 x DP 1)" in (tmp_path / "msrun-logs-0" / "worker_0.log").read_text(errors="replace")
    assert_same_results(one, tp, ("mmlu", "gsm8k"))
