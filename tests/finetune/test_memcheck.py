"""The step-1 memory record (finetune/run/memcheck.py): the plan's estimate beside the measured peak."""
from __future__ import annotations

import json

import pytest

import finetune.run.loop as loop
from finetune.run.memcheck import measured, memory_record, out_of_memory, plan_estimate
from jobspec.config import resolved_model_dir
from jobspec.finish import finished
from jobspec.lifecycle import DeviceOutOfMemory, run_rank
from jobspec.memory import MemoryEstimate
from jobspec.memory_terms import SHRINKS
from jobspec.recipe_load import load_recipe
from jobspec.rundir import run_dir_of
from jobspec.tiny import ensure_tiny_model

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


# MindSpore 2.10's own failed allocations, recorded: on this machine (CPU, PyNative, a 64 GB tile under `ulimit -v`:
# str() of the RuntimeError), and on Ascend as MindSpore's tutorial on heterogeneous storage prints it (a static
# allocation beyond a 32 GB device; the text is in 2.10's libmindspore_ascend_res_manager.so)
CPU_OOM = ("Allocate memory failed\n\n----------------------------------------------------\n- C++ Call Stack: (For "
           "framework developers)\n----------------------------------------------------\n"
           "mindspore/ccsrc/backend/common/device_address_utils.cc:1300 MallocForOutputs\n")
ASCEND_OOM = ("----------------------------------------------------\n- Framework Error Message:\n"
              "----------------------------------------------------\nOut of Memory!!! Request memory size: "
              "33100113920B, Memory Statistic:\nDevice HBM memory size: 32768M\nMindSpore Used memory size: 30684M\n"
              "MindSpore memory base address: 0x124140000000\nTotal Static Memory size: 496M\nTotal Dynamic memory "
              "size: 0M\nDynamic memory size of this graph: 0M\n\nPlease try to reduce 'batch_size' or check whether "
              "exists extra large shape.")


def _plan(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"memory": {**EST.parts(), "total": EST.total}}))
    return plan


def test_a_failed_device_allocation_is_named_with_the_plans_estimate_and_what_shrinks_it(tmp_path):
    for text, first in ((CPU_OOM, "Allocate memory failed"), (ASCEND_OOM, "Out of Memory!!! Request memory size: "
                                                                          "33100113920B, Memory Statistic:")):
        named = out_of_memory(RuntimeError(text), _plan(tmp_path), "after 0 of 10 steps")
        assert named is not None and "\n" not in str(named)
        assert str(named).startswith("device memory ran out after 0 of 10 steps; the plan estimated 38.00 GiB per "
                                     "device; the largest term is optimizer (20.00 GiB), shrunk by "
                                     f"{SHRINKS['optimizer']}")
        assert str(named).endswith(f"MindSpore: {first}")
    named = out_of_memory(RuntimeError(CPU_OOM), tmp_path / "none.json", "while loading the model")
    assert named is not None and "no estimate in" in str(named) and "python -m launcher plan" in str(named)
    for other in ("Allocate pin memory failed, size: 1024", "HCCL timeout",
                  "Tensor.pin_memory allocate memory failed!"):
        assert out_of_memory(RuntimeError(other), _plan(tmp_path), "after 1 of 10 steps") is None


def test_a_training_run_that_runs_out_of_device_memory_ends_with_one_line_naming_it(tmp_path, monkeypatch, capsys):
    """The rank's error (jobspec/lifecycle.py run_rank: one stderr line, the traceback in the status file) is the
    named one; MindSpore's own stays chained in that traceback. Other errors pass unchanged."""
    recipe = load_recipe("tiny-cpu", {"output_dir": str(tmp_path / "out"), "train.max_steps": "5",
                                      "data.seq_len": "64", "data.max_samples": "16", "data.val_size": "0"})
    ensure_tiny_model(resolved_model_dir(recipe), recipe.model.init, recipe.model.init_seed)
    recipe = finished(recipe)
    run_dir_of(recipe).plan.parent.mkdir(parents=True, exist_ok=True)
    _plan(run_dir_of(recipe).plan.parent)

    def failing(*a, **k):
        raise RuntimeError(CPU_OOM)

    monkeypatch.setattr(loop, "accumulate", failing)
    assert run_rank(tmp_path / "logs", 3, lambda: loop.run(recipe)) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "C++ Call Stack" not in err
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and lines[0].startswith("[rank 3] error: DeviceOutOfMemory: device memory ran out after 0 "
                                                   "of 5 steps; the plan estimated 38.00 GiB per device")
    status = json.loads(next((tmp_path / "logs").rglob("*.json")).read_text())
    assert "MallocForOutputs" in status["error"]["traceback"]  # MindSpore's own, chained
    monkeypatch.setattr(loop, "accumulate", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("HCCL timeout")))
    with pytest.raises(RuntimeError, match="^HCCL timeout$") as info:
        loop.run(recipe)
    assert not isinstance(info.value, DeviceOutOfMemory)
