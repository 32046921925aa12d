"""ZeRO-3 with LoRA and with ``train.recompute`` (issue 33 item 1) is the one-process computation.

One process first (DP 1, a gather is the chunk itself): with LoRA the frozen base's decoder-layer weights are
released to placeholders beside the adapters, the loss and the adapters' gradients are the plain LoRA model's (with
dropout too: the recomputed backward draws the forward's masks again), and ``whole`` gives the base back bit for bit. Then under msrun the runs of test_zero2_msrun.py (tiny Qwen2, 20 steps,
global batch 8, fp32; its helpers): LoRA DP 2 and TP 2 x DP 2 ZeRO-3 against LoRA in one process (losses, the peft
adapter and the merged export), the DP 2 run's step-10 checkpoint resumed in one process, and
``train.recompute=true`` DP 2 ZeRO-3 against one process with MindSpore's recompute cells.
"""
import json
import math
import shutil
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from safetensors.numpy import load_file
from test_zero2_msrun import LR, _run
from test_zero3_layers import assert_same_step
from test_zero3_msrun import SAVE, _same_run

from finetune.dist import RankInfo
from finetune.model.decoder import DecoderLM, ModelConfig
from finetune.model.lora import apply_lora
from finetune.optim import ShardedAdamW
from finetune.parallel.zero3 import Zero3Reduction, shard_layers
from finetune.parallel.zero3_lora import shard_frozen_base
from jobspec.config import TrainConfig
from jobspec.lora_config import LoraConfig
from jobspec.memory import layer_elements
from jobspec.model_layout import full_shapes
from jobspec.recipe_load import load_recipe
from jobspec.tiny import tiny_config

LORA = {"train.method": "lora", "lora.dropout": "0", "lora.r": "4"}  # dropout masks are keyed by DP rank


def _lora_model(dropout: float) -> tuple[DecoderLM, list]:
    ms.set_seed(0)
    model = DecoderLM(ModelConfig.from_dict(tiny_config({"vocab_size": 512})))
    params = apply_lora(model, LoraConfig(r=4, dropout=dropout), 0)
    model.set_train(True)
    model.lora_masks.advance(0, (2, 16))  # the masks of step 0's first micro-batch (keyed: drawn again alike)
    rng = np.random.default_rng(1)  # B nonzero, so that A has a gradient too
    for p in params:
        if p.name.endswith("lora_B.weight"):
            p.set_data(ms.Tensor(rng.normal(0, 0.1, p.shape).astype(np.float32)))
    return model, params


@pytest.mark.parametrize("dropout", [0.0, 0.1])  # 0.1: the recomputed backward draws the forward's masks again
def test_lora_layers_release_the_frozen_base_and_give_the_plain_lora_models_loss_and_gradients(ms_cpu, dropout):
    (plain, ref_params), (model, params) = _lora_model(dropout), _lora_model(dropout)
    base = [p for p in model.get_parameters() if ".layers." in p.name and not p.requires_grad]
    whole = {p.name: p.asnumpy().copy() for p in base}
    opt = ShardedAdamW(params, TrainConfig(), RankInfo())
    weights = shard_layers(model, opt, RankInfo())
    shard_frozen_base(model, weights, RankInfo())
    reduction = Zero3Reduction(params, opt, weights)
    weights.release()
    assert base and all(int(np.prod(p.shape)) == 1 for p in base)
    assert sorted(p.name for p in model.get_parameters()) == sorted(p.name for p in plain.get_parameters())

    assert_same_step(model, params, reduction, opt, plain, ref_params)
    assert all(int(np.prod(p.shape)) == 1 for p in base)  # released again after the backward

    with weights.on_host(keep=True):  # the rank writing the checkpoint: the frozen base whole too, on the host
        for p in base:
            np.testing.assert_array_equal(p.asnumpy(), whole[p.name], err_msg=p.name)
    assert all(int(np.prod(p.shape)) == 1 for p in base)


@pytest.fixture(scope="module")
def tmp(module_tmp) -> Path:
    from jobspec.tiny import ensure_tiny_model

    ensure_tiny_model(module_tmp / "base-model", load_recipe("tiny-cpu").model.init, 0)
    return module_tmp


def _adapters_close(out: Path, ref: Path, what: str) -> None:
    """The peft adapters within lr / 100, as the exported weights (test_zero2_msrun.py says why)."""
    a, b = (load_file(str(o / "adapter" / "adapter_model.safetensors")) for o in (out, ref))
    assert a.keys() == b.keys() and all(np.abs(b[k]).max() > 0 for k in b)  # trained: B left its zero init
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    print(f"{what}: largest adapter difference {worst:.3g}")
    assert worst <= LR / 100


@pytest.mark.slow
@pytest.mark.parametrize("tp, dp", [(1, 2), (2, 2)])  # TP 2: each TP rank's adapters and base over its DP group
def test_lora_zero3_equals_lora_in_one_process(tmp, tp, dp):
    ref = _run(tmp, "lora-one", 1, **LORA)
    out = _run(tmp, f"lora-tp{tp}dp{dp}-zero3", dp, tp, **{"parallel.zero": "3", **LORA, **SAVE})
    log = (out / "msrun-logs-0" / "worker_0.log").read_text(errors="replace")
    assert "ZeRO-3 with LoRA: the frozen base's decoder layers" in log
    assert f"each rank keeps 1/{dp} of every layer's frozen weights" in log
    _same_run(out, ref, f"LoRA tp {tp} dp {dp} ZeRO-3")
    _adapters_close(out, ref, f"LoRA tp {tp} dp {dp} ZeRO-3")
    if tp == 1:  # dp_sent_bytes counts the base's gathers: each layer twice per micro-batch, (d-1)/d of it sent
        sent = np.diff([json.loads(x)["dp_sent_bytes"] for x in (out / "metrics.jsonl").read_text().splitlines()])
        shapes = full_shapes(tiny_config(load_recipe("tiny-cpu").model.init))
        base = sum(math.ceil(n / dp) * (dp - 1) * 4 for n in layer_elements(shapes))
        print(f"LoRA dp {dp} ZeRO-3: {sent.min()} bytes sent per step, {2 * 8 // dp * base} of them the base's")
        assert sent.min() >= 2 * (8 // dp) * base  # global batch 8: grad_accum 8 / dp


@pytest.mark.slow
def test_a_lora_zero3_checkpoint_resumes_in_one_process(tmp):
    """The LoRA DP 2 ZeRO-3 run's step-10 checkpoint (whole adapters, ZeRO-1's optimizer shards) continues in one
    process as the ZeRO-3 run itself went on (steps 11-20)."""
    src = _run(tmp, "lora-tp1dp2-zero3", 2, **{"parallel.zero": "3", **LORA, **SAVE})
    ckpt = "checkpoints/step_00000010"
    if not (tmp / "lora-resume-one" / "hf").is_dir():
        shutil.copytree(src / ckpt, tmp / "lora-resume-one" / ckpt, dirs_exist_ok=True)
    out = _run(tmp, "lora-resume-one", 1, **{**LORA, **SAVE})
    _same_run(out, src, "LoRA ZeRO-3 dp 2 -> one process", after=10)
    _adapters_close(out, src, "LoRA ZeRO-3 dp 2 -> one process")


@pytest.mark.slow
def test_recompute_dp2_zero3_equals_one_process_with_recompute_cells(tmp):
    """ZeRO-3 recomputes each layer itself (zero3.GatheredLayer) and leaves MindSpore's recompute cells out; the
    reference recomputes through them."""
    ref = _run(tmp, "recompute-one", 1, **{"train.recompute": "true"})
    out = _run(tmp, "recompute-dp2-zero3", 2, **{"parallel.zero": "3", "train.recompute": "true"})
    _same_run(out, ref, "recompute dp 2 ZeRO-3")
