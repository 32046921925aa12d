"""The evaluator under msrun with 2 CPU workers (each a share of the documents, results gathered) gives the
one-process numbers: the same documents, log-likelihoods within the issue's 1e-4, the same accuracies,
generated answers and perplexities."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import harness
import numpy as np
import pytest

from jobspec.config import REPO_ROOT
from jobspec.tiny import ensure_tiny_model

DATA = REPO_ROOT / "tests" / "finetune" / "eval" / "data"
TOOL = REPO_ROOT / "finetune" / "eval" / "__main__.py"
GOLDEN_MODEL = json.loads((REPO_ROOT / "tests" / "finetune" / "eval" / "golden.json").read_text())["model"]


def samples(out: Path, task: str) -> list[dict]:
    return [json.loads(line) for line in (out / f"samples_{task}.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_dp2_under_msrun_equals_one_process(tmp_path):
    model = tmp_path / "model"
    ensure_tiny_model(model, GOLDEN_MODEL["overrides"], GOLDEN_MODEL["seed"], GOLDEN_MODEL["std"])
    args = ["--model", f"base={model}", "--data-dir", str(DATA), "--tasks", "mmlu,ceval-valid,gsm8k,perplexity",
            "--num-fewshot", "1", "--max-gen-toks", "12", "--batch-size", "2", "--device", "cpu"]
    subprocess.run([sys.executable, str(TOOL), *args, "--out", str(tmp_path / "one")], check=True, cwd=REPO_ROOT,
                   timeout=900)
    harness.msrun(TOOL, [*args, "--out", str(tmp_path / "dp")], 2, tmp_path)
    assert "on 2 ranks" in (tmp_path / "msrun-logs-0" / "worker_0.log").read_text(errors="replace")
    one, dp = (json.loads((tmp_path / d / "base.json").read_text())["results"] for d in ("one", "dp"))
    assert one.keys() == dp.keys() and "mmlu_stem" in one
    for name, r in one.items():
        for metric, value in r.items():
            if metric.startswith(("acc", "exact_match")) or metric in ("n", "num_fewshot"):
                assert dp[name][metric] == value, (name, metric)
            elif metric.endswith("perplexity") or metric == "bits_per_byte":
                assert dp[name][metric] == pytest.approx(value, rel=1e-5), (name, metric)
    for task in ("mmlu", "ceval-valid"):
        a, b = samples(tmp_path / "one", task), samples(tmp_path / "dp", task)
        assert [(s["subtask"], s["doc_id"]) for s in a] == [(s["subtask"], s["doc_id"]) for s in b]
        np.testing.assert_allclose([s["loglikelihoods"] for s in b], [s["loglikelihoods"] for s in a], rtol=0,
                                   atol=1e-4)
    assert [s["response"] for s in samples(tmp_path / "dp", "gsm8k")] == \
        [s["response"] for s in samples(tmp_path / "one", "gsm8k")]
    assert not list((tmp_path / "dp").glob(".dp-*"))  # the ranks' exchange files are gone
