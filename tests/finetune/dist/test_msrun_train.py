"""The real trainer under msrun (tiny Qwen2, CPU workers) is the one-process computation.

Same data, seed and global batch (4 sequences: micro batch 2 x grad_accum 2/dp x dp) in every
layout; compared: the per-step losses in metrics.jsonl (rel 1e-4, 5 steps) and the exported
Hugging Face weights. One module-scoped one-process run is the reference for all.
"""
import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import harness
from jobspec.config import to_dict
from jobspec.recipe_load import load_recipe

pytestmark = pytest.mark.slow
WORKER = harness.REPO / "finetune" / "worker.py"
STEPS = 5
GLOBAL_SEQS = 4
LR = 5e-3


def _plan(tmp: Path, name: str, tp: int, dp: int, layout: dict | None = None, **extra: str) -> Path:
    """Write <tmp>/<name>/plan.json; the model and token cache are shared by every run. ``layout``: the
    recipe resolved for world tp x dp as the launcher writes it, with these fields of its layout changed."""
    over = {"output_dir": str(tmp / name), "model.dir": str(tmp / "base-model"), "data.cache_dir": str(tmp / "cache"),
            "data.seq_len": "64", "data.max_samples": "48", "train.micro_batch_size": "2",
            "train.grad_accum": str(GLOBAL_SEQS // 2 // dp), "train.max_steps": str(STEPS), "train.log_every": "1",
            "train.warmup_steps": "1", "train.lr": str(LR), "train.save_every": "0", "parallel.tp": str(tp),
            "parallel.dp": str(dp), "export.dtype": "fp32", **extra}
    (tmp / name).mkdir(parents=True, exist_ok=True)
    plan = tmp / name / "plan.json"
    recipe = load_recipe("tiny-cpu", over)
    if layout is not None:
        recipe = recipe.resolved(tp * dp, "cpu")
        recipe = dataclasses.replace(recipe, layout=dataclasses.replace(recipe.decided_layout, **layout))
    plan.write_text(json.dumps({"recipe": to_dict(recipe)}))
    return plan


def _msrun(tmp: Path, name: str, workers: int, nodes: int = 1, **kw) -> Path:
    harness.msrun(WORKER, ["--config", str(tmp / name / "plan.json")], workers, tmp / name, nodes=nodes, **kw)
    return tmp / name


def _run_once(tmp: Path, name: str, tp: int, dp: int, workers: int, nodes: int = 1, layout: dict | None = None,
              **extra: str) -> Path:
    """Plan and run a complete job unless this module already ran it."""
    if not (tmp / name / "hf").is_dir():
        _plan(tmp, name, tp, dp, layout, **extra)
        _msrun(tmp, name, workers, nodes)
    return tmp / name


def _losses(out: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def _evals(out: Path) -> list[float]:
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["eval_loss"] for r in records if "eval_loss" in r]


def _rank0_log(out: Path) -> str:
    return (out / "msrun-logs-0" / "worker_0.log").read_text(errors="replace")


def _hf(out: Path) -> dict[str, np.ndarray]:
    w: dict[str, np.ndarray] = {}
    for f in sorted((out / "hf").glob("*.safetensors")):
        w.update(load_file(str(f)))
    return w


def _assert_same_run(got: Path, ref: Path) -> None:
    a, b = _losses(got), _losses(ref)
    assert len(a) == len(b) == STEPS
    np.testing.assert_allclose(a, b, rtol=1e-4)
    ea, eb = _evals(got), _evals(ref)  # the held-out 5%: each rank's share, summed over DP
    assert len(ea) == len(eb) == 1
    np.testing.assert_allclose(ea, eb, rtol=1e-4)
    wa, wb = _hf(got), _hf(ref)
    assert wa.keys() == wb.keys() and wa
    for k in wa:
        # Adam's normalised step turns float noise in a gradient that is ~0 (terms cancelling) into up
        # to lr per step: a few elements per million may differ by more than 1e-4, never by a step.
        off = ~np.isclose(wa[k], wb[k], rtol=1e-4, atol=1e-4)
        assert off.sum() <= max(1, wa[k].size // 10**6), (k, int(off.sum()), np.abs(wa[k] - wb[k]).max())
        np.testing.assert_allclose(wa[k], wb[k], rtol=0, atol=LR, err_msg=k)


def _model_bytes(out: Path) -> list[int]:
    return [f.stat().st_size for f in sorted((out / "checkpoints").glob("step_*/model_rank*.safetensors"))]


def _optim_bytes(out: Path) -> list[int]:
    return [f.stat().st_size for f in sorted((out / "checkpoints").glob("step_*/optim_rank*.safetensors"))]


@pytest.fixture(scope="module")
def tmp(module_tmp) -> Path:
    """The one-process reference run (it also creates the tiny model and the token cache)."""
    tmp = module_tmp
    from jobspec.tiny import ensure_tiny_model

    ensure_tiny_model(tmp / "base-model", load_recipe("tiny-cpu").model.init, 0)
    harness.python(WORKER, ["--config", str(_plan(tmp, "one", 1, 1))], tmp / "one")
    return tmp


def test_dp2_sharded_and_unsharded_equal_one_process(tmp):
    _assert_same_run(_run_once(tmp, "dp2", 1, 2, 2), tmp / "one")  # shard_optimizer unset: on (dp > 1)
    # the plan's layout is what the workers use: its parallel section leaves shard_optimizer unset (on with
    # dp 2), the layout the launcher decided says off, and off it is
    full_run = _run_once(tmp, "dp2-full", 1, 2, 2, layout={"shard_optimizer": False})
    plan = json.loads((full_run / "plan.json").read_text())["recipe"]
    assert plan["parallel"]["shard_optimizer"] is None and plan["layout"]["shard_optimizer"] is False
    _assert_same_run(full_run, tmp / "one")
    sharded, full = _optim_bytes(tmp / "dp2"), _optim_bytes(tmp / "dp2-full")
    assert len(sharded) == 2 and len(full) == 1  # unsharded state is stored once (DP replicas equal)
    for b in sharded:
        assert abs(b - full[0] / 2) / (full[0] / 2) < 0.01, (sharded, full)


def test_dp2_with_compiled_layers_equals_the_op_by_op_one_process(tmp):
    """Compiled layers (on by default on CPU, with DP and the sharded optimizer) see every update the
    optimizer writes in place: DP 2, sharded or not, equals one process whose layers run op by op."""
    ref = tmp / "one-opbyop"
    if not (ref / "hf").is_dir():
        harness.python(WORKER, ["--config", str(_plan(tmp, "one-opbyop", 1, 1, **{"train.compile_layers": "false"}))],
                       ref)
    for name, shard in (("dp2", "true"), ("dp2-full", "false")):
        got = _run_once(tmp, name, 1, 2, 2, **{"parallel.shard_optimizer": shard})
        assert "decoder layers runs as one graph" in _rank0_log(got)
        _assert_same_run(got, ref)


def test_dp2_accumulating_with_compiled_layers_equals_the_op_by_op_one_process(tmp):
    """DP 2 x grad_accum 2 (micro batch 1) with compiled layers, the NPU recipes' shape: the last micro-batch's
    hooks sum into the accumulator during the compiled layers' backward. MindSpore 2.10 failed that backward
    ("Failure info [Size not match]") while the sum was written in place; now it equals one process."""
    ref = tmp / "one-opbyop"
    if not (ref / "hf").is_dir():
        harness.python(WORKER, ["--config", str(_plan(tmp, "one-opbyop", 1, 1, **{"train.compile_layers": "false"}))],
                       ref)
    for name, shard in (("dp2-ga2", "true"), ("dp2-ga2-full", "false")):
        got = _run_once(tmp, name, 1, 2, 2, **{"parallel.shard_optimizer": shard, "train.micro_batch_size": "1",
                                               "train.grad_accum": "2"})
        assert "decoder layers runs as one graph" in _rank0_log(got)
        _assert_same_run(got, ref)


def test_an_untied_embeddings_rows_under_dp2_accumulating_equal_one_process(tmp):
    """An untied embedding's gradient summed as its rows (parallel/vocab.py RowGradient; the tiny model ties its
    embedding): DP 2 x grad_accum 2, sharded or not, through the overlap's hooks and the shared-memory sums, equals
    one process (micro batch 2 x grad_accum 2: rows as well)."""
    from jobspec.tiny import ensure_tiny_model

    model = tmp / "untied-model"
    ensure_tiny_model(model, {**load_recipe("tiny-cpu").model.init, "tie_word_embeddings": False}, 0)
    ref = tmp / "untied-one"
    if not (ref / "hf").is_dir():
        harness.python(WORKER, ["--config", str(_plan(tmp, "untied-one", 1, 1, **{"model.dir": str(model)}))], ref)
    for name, shard in (("untied-dp2-ga2", "true"), ("untied-dp2-ga2-full", "false")):
        got = _run_once(tmp, name, 1, 2, 2, **{"model.dir": str(model), "parallel.shard_optimizer": shard,
                                               "train.micro_batch_size": "1", "train.grad_accum": "2"})
        assert "summed as the rows" in _rank0_log(got)
        _assert_same_run(got, ref)


def test_dp2_reduction_after_the_backward_equals_the_overlapped_one_bit_for_bit(tmp):
    """parallel.overlap_grad_reduce (on by default) starts each bucket's reduction from the backward's
    hooks; off, the same buckets are reduced after it: the same sums, so the same run."""
    for name in ("dp2", "dp2-full"):
        shard = "true" if name == "dp2" else "false"
        sync = _run_once(tmp, name + "-sync", 1, 2, 2, **{"parallel.overlap_grad_reduce": "false",
                                                        "parallel.shard_optimizer": shard})
        overlapped = _run_once(tmp, name, 1, 2, 2, **{"parallel.shard_optimizer": shard})
        assert "each started by the backward" in _rank0_log(overlapped)  # the two runs took different paths
        assert "after the backward (parallel.overlap_grad_reduce: false)" in _rank0_log(sync)
        assert _losses(sync) == _losses(overlapped)
        a, b = _hf(sync), _hf(overlapped)
        assert a.keys() == b.keys() and a
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{name} {k}")


def test_dp2_through_shared_memory_equals_dp2_through_mindspores_collectives(tmp):
    """parallel.host_collectives (on by default for CPU workers on one node) moves the DP sums through
    /dev/shm; off, MindSpore's CPU collectives move them: the same training, sharded or not."""
    for name, shard in (("dp2", "true"), ("dp2-full", "false")):
        host = _run_once(tmp, name, 1, 2, 2, **{"parallel.shard_optimizer": shard})
        mccl = _run_once(tmp, name + "-mccl", 1, 2, 2, **{"parallel.shard_optimizer": shard,
                                                          "parallel.host_collectives": "false"})
        assert "DP sums through shared memory" in _rank0_log(host)
        assert "shared memory" not in _rank0_log(mccl)
        _assert_same_run(host, mccl)


def test_tp2_equals_one_process(tmp):
    """Vocab-parallel embedding/LM head with the parallel cross-entropy (the default), and replicated."""
    _assert_same_run(_run_once(tmp, "tp2", 2, 1, 2), tmp / "one")
    _assert_same_run(_run_once(tmp, "tp2-replicated", 2, 1, 2, **{"parallel.vocab_parallel": "false"}), tmp / "one")
    vp, rep = _model_bytes(tmp / "tp2"), _model_bytes(tmp / "tp2-replicated")
    embed = 151936 * 64 * 4  # the tied embedding: split in two halves, or whole on both ranks
    assert len(vp) == len(rep) == 2 and all(r - v == pytest.approx(embed / 2, rel=1e-3) for v, r in zip(vp, rep))


def test_tp2_dp2_on_two_nodes_equals_one_process(tmp):
    """4 workers as two msrun "nodes" of 2 (TP groups inside a node), sharded optimizer over DP."""
    _assert_same_run(_run_once(tmp, "tp2dp2", 2, 2, 4, nodes=2), tmp / "one")
    sharded, per_tp_rank = _optim_bytes(tmp / "tp2dp2"), _optim_bytes(_run_once(tmp, "tp2", 2, 1, 2))
    assert len(sharded) == 4 and len(per_tp_rank) == 2
    for b in sharded:  # each rank: half of its TP slice's state
        assert abs(b - per_tp_rank[0] / 2) / (per_tp_rank[0] / 2) < 0.01, (sharded, per_tp_rank)


def test_killed_mid_run_and_resumed_equals_uninterrupted(tmp):
    """SIGINT to msrun kills every worker after a mid-run checkpoint; rerunning resumes from it."""
    name = "dp2-resume"
    _plan(tmp, name, 1, 2, **{"train.save_every": "2"})
    ckpt = tmp / name / "checkpoints" / "step_00000002" / "manifest.json"
    _msrun(tmp, name, 2, kill_when=ckpt.is_file)
    assert not (tmp / name / "hf").exists() and len(_losses(tmp / name)) < STEPS
    shutil.rmtree(tmp / name / "msrun-logs-0")
    _msrun(tmp, name, 2)
    assert _losses(tmp / name) == _losses(_run_once(tmp, "dp2", 1, 2, 2))
    _assert_same_run(tmp / name, tmp / "one")


def test_tp4_replicated_kv_heads_equal_one_process(tmp):
    """tp=4 > 2 KV heads: each KV head lives on two ranks; their gradients are summed (SumOverReplicas)."""
    _assert_same_run(_run_once(tmp, "tp4", 4, 1, 4), tmp / "one")
