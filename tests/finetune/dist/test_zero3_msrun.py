"""ZeRO-3 (``parallel.zero: 3``) under msrun is the one-process computation (issue 33 items 3 and 4).

The runs and their comparison are test_zero2_msrun.py's (tiny Qwen2, 20 steps, global batch 8 = micro batch 1 x
grad_accum 8/dp x dp, fp32; its helpers, imported): every decoder layer gathered for its forward and again for its
recomputed backward, gradients reduce-scattered per micro-batch, each rank updating and keeping its weight chunks.
A ZeRO-3 checkpoint is ZeRO-1's (same keys and shapes), so it resumes at ZeRO-1 and in one process.
"""
import json
from pathlib import Path

import harness
import numpy as np
import pytest
from test_zero2_msrun import LR, STEPS, WORKER, _hf, _losses, _run

from jobspec.config import load_recipe, to_dict

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tmp(module_tmp) -> Path:
    from jobspec.tiny import ensure_tiny_model

    ensure_tiny_model(module_tmp / "base-model", load_recipe("tiny-cpu").model.init, 0)
    _run(module_tmp, "one", 1)
    return module_tmp


def _same_run(out: Path, ref: Path, what: str) -> None:
    """Losses within 1e-6 relative, exported weights within lr / 100 (test_zero2_msrun.py says why)."""
    got, want = _losses(out), _losses(ref)
    assert len(got) == len(want) == STEPS
    print(f"{what}: largest loss difference {np.abs(got - want).max():.3g}")
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    wa, wb = _hf(out), _hf(ref)
    assert wa.keys() == wb.keys() and wa
    worst = max(float(np.abs(wa[k] - wb[k]).max()) for k in wa)
    print(f"{what}: largest exported weight difference {worst:.3g}")
    assert worst <= LR / 100


@pytest.mark.parametrize("tp, dp, extra", [(1, 2, {}), (1, 4, {"parallel.host_collectives": "false"}),
                                           (2, 2, {})])  # sharded over each TP rank's DP group
def test_zero3_equals_one_process(tmp, tp, dp, extra):
    name = f"dp{dp}-zero3" if tp == 1 else f"tp{tp}dp{dp}-zero3"
    out = _run(tmp, name, dp, tp, **{"parallel.zero": "3", **extra})
    assert "ZeRO-3: each rank keeps 1/" in (out / "msrun-logs-0" / "worker_0.log").read_text(errors="replace")
    _same_run(out, tmp / "one", f"tp {tp} dp {dp} ZeRO-3")
