"""An export that finds non-finite weights fails the whole job with EXIT_DIVERGED on every rank.

The export runs on DP rank 0's TP group only (``hf_io.export_hf``: under ZeRO-3 only that rank holds the whole
weights), so the other DP ranks learn of a failure through ``run.loop.finish``'s all-reduce; before it they went on
to the sample check and the final barrier and waited until MindSpore's scheduler timed them out.
"""
import pytest
from test_zero2_msrun import _run

from jobspec.lifecycle import log_dir, read_statuses

pytestmark = pytest.mark.slow


def test_an_unexportable_model_fails_every_dp_rank_with_the_divergence_code(tmp_path):
    from finetune.run.loop import EXIT_DIVERGED
    from jobspec.recipe_load import load_recipe
    from jobspec.tiny import ensure_tiny_model

    ensure_tiny_model(tmp_path / "base-model", load_recipe("tiny-cpu").model.init, 0)
    # Adam moves each weight by about lr per step: 1e5 is far outside fp16's range (65504), finite in fp32
    with pytest.raises(AssertionError):
        _run(tmp_path, "fp16-overflow", 2, **{"train.lr": "100000", "train.max_steps": "2",
                                               "train.warmup_steps": "0", "export.dtype": "fp16"})
    out = (tmp_path / "fp16-overflow" / "msrun-0.out").read_text(errors="replace")
    assert f"exit with exception. Error code: {EXIT_DIVERGED}." in out, out[-3000:]  # msrun names the first to end
    # no rank left waiting: before, rank 1 sat in the sample check until the scheduler timed it out and its status
    # stayed "running". Not "is timed out" absent from msrun's output: msrun kills the other workers as soon as one
    # exits non-zero, and one killed while MindSpore finalizes its cluster node is reported timed out 30 s later
    statuses = read_statuses(log_dir(tmp_path / "fp16-overflow"))
    assert {r: s.get("exit_code") for r, s in statuses.items()} == {0: EXIT_DIVERGED, 1: EXIT_DIVERGED}, statuses
    assert not (tmp_path / "fp16-overflow" / "hf").exists()
