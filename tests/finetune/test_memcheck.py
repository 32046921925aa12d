"""The step-1 memory record (finetune/run/memcheck.py): the plan's estimate beside the measured peak."""
from __future__ import annotations

import json

from finetune.run.memcheck import measured, memory_record, plan_estimate
from jobspec.memory import MemoryEstimate
from jobspec.memory_terms import SHRINKS

EST = MemoryEstimate(weights=10 * 2**30, grads=2 * 2**30, master=0, optimizer=20 * 2**30, activations=2**30,
                     workspace=2**30, accumulator=4 * 2**30)


def test_a_device_peak_above_the_estimate_by_more_than_5_percent_warns_naming_the_largest_term_and_its_setting():
    assert EST.total == 38 * 2**30 and EST.largest() == "optimizer"
    peak = {"memory_source": "device", "memory_peak_allocated_bytes": 39 * 2**30,
            "memory_peak_reserved_bytes": int(EST.total * 1.06)}
    fields, line = memory_record(EST, peak)
    assert "warning" in line and "+6%" in line and "optimizer" in line and SHRINKS["optimizer"] in line
    assert fields["memory_estimate_bytes"] == EST.total and fields["memory_peak_reserved_bytes"] == peak[
        "memory_peak_reserved_bytes"] and fields["memory_estimate_terms"]["accumulator"] == 4 * 2**30
    _, line = memory_record(EST, {**peak, "memory_peak_reserved_bytes": int(EST.total * 1.04)})
    assert "warning" not in line and "+4%" in line


def test_on_cpu_the_record_is_the_peak_rss_and_says_so():
    peak = measured()  # MindSpore 2.10 on CPU reports 0 device bytes
    assert peak["memory_source"] == "rss" and int(peak["memory_peak_rss_bytes"]) > 2**20
    fields, line = memory_record(EST, peak)
    assert "warning" not in line and "RSS" in line and fields["memory_source"] == "rss"


def test_the_estimate_comes_from_plan_json_and_without_one_from_the_recipe(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"memory": {**EST.parts(), "total": EST.total}}))
    assert plan_estimate(plan, None, {}) == EST
    from jobspec.recipe_load import load_recipe
    from jobspec.tiny import tiny_config

    recipe = load_recipe("recipes/tiny-cpu.yaml").resolved(1, "cpu")
    got = plan_estimate(tmp_path / "missing.json", recipe, tiny_config())
    assert got.total > 0 and got.staging > 0  # the recipe's own, on CPU


def test_summary_json_carries_the_step_1_memory_fields():
    from finetune.run.summary import summary

    fields, _ = memory_record(EST, {"memory_source": "rss", "memory_peak_rss_bytes": 5 * 2**30})
    records = [{"step": 1, "loss": 2.0, **fields}, {"step": 2, "loss": 1.0, "memory_estimate_bytes": 1}]
    s = summary(records, tokens=10, wall_s=1.0)
    assert s["memory_estimate_bytes"] == EST.total and s["memory_peak_rss_bytes"] == 5 * 2**30
    assert s["memory_source"] == "rss" and s["memory_estimate_terms"]["optimizer"] == 20 * 2**30
    assert "memory_estimate_bytes" not in summary([{"step": 1, "loss": 2.0}], tokens=1, wall_s=1.0)
