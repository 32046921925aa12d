"""`make bench-dp` (tools/bench_dp.py): what it reads from a run and how it compares the two."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "tools" / "bench_dp.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_dp", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_a_run_is_timed_after_its_warm_up_steps_and_rounds_are_compared_pairwise(tmp_path):
    bench = load_bench()
    rows = [{"step": i + 1, "loss": 10.0 - i, "tokens_per_s": tps} for i, tps in enumerate([5.0, 50.0, 90.0, 110.0,
                                                                                              100.0])]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(r) for r in [*rows, {"eval_loss": 3.0}]) + "\n")
    assert bench.read_run(metrics) == (100.0, [10.0, 9.0, 8.0, 7.0, 6.0])  # steps 1-2 (compile, first touch) left out
    metrics.write_text("\n".join(json.dumps(r) for r in rows[:2]))
    with pytest.raises(ValueError, match="2 step"):
        bench.read_run(metrics)
    assert bench.sent_per_step(metrics) is None  # a run without the transport's counter
    metrics.write_text("\n".join(json.dumps({**r, "dp_sent_bytes": 10 + 7 * r["step"]}) for r in rows) + "\n")
    assert bench.sent_per_step(metrics) == 7
    assert bench.summarize([(100.0, 90.0), (200.0, 190.0), (100.0, 120.0)]) == pytest.approx(
        {"median": 0.95, "min": 0.9, "max": 1.2, "n": 3})
    # the two runs differ only in workers and micro-batch: same rows per step, nothing saved or exported
    one, dp = bench.run_overrides(12, 4).split(), bench.run_overrides(12, 2).split()
    assert set(one) ^ set(dp) == {"train.micro_batch_size=4", "train.micro_batch_size=2"}
    assert {"train.save_every=0", "export.enabled=false", "train.max_steps=12"} <= set(one)
