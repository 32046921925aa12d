"""LoRA under msrun (tiny Qwen2, CPU workers): TP 2 x DP 2 with the sharded optimizer equals the one-process
run (losses, eval loss, the merged export) and writes the same adapter. Heavy: run under flock /tmp/heavy.lock."""
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
import harness
from test_msrun_train import WORKER, _assert_same_run, _plan, _run_once

from jobspec.recipe_load import load_recipe

pytestmark = pytest.mark.slow
LORA = {"train.method": "lora", "lora.dropout": "0", "lora.r": "4"}


@pytest.fixture(scope="module")
def tmp(module_tmp) -> Path:
    from jobspec.tiny import ensure_tiny_model

    ensure_tiny_model(module_tmp / "base-model", load_recipe("tiny-cpu").model.init, 0)
    harness.python(WORKER, ["--config", str(_plan(module_tmp, "one", 1, 1, **LORA))], module_tmp / "one")
    return module_tmp


def test_tp2_dp2_lora_equals_one_process(tmp):
    got = _run_once(tmp, "tp2dp2", 2, 2, 4, **LORA)
    _assert_same_run(got, tmp / "one")
    a = load_file(str(got / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp / "one" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and len(a) == 28
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=0, atol=5e-3, err_msg=k)  # within one Adam step (lr)
        assert np.abs(b[k]).max() > 0
