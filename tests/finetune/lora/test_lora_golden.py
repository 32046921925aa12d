"""LoRA parity with transformers + peft (goldens from tools/make_lora_golden.py): loss, every adapter
gradient, one AdamW step; the frozen base gets no gradient and no optimizer state."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.tolerances import assert_fp32_close

HERE = Path(__file__).resolve().parent
BASE = HERE.parent / "golden" / "untied"
G = HERE / "golden" / "golden.npz"


def grad_terms() -> int:
    """The summands of an adapter gradient: every token of the golden batch times the hidden size."""
    hidden = json.loads((BASE / "config.json").read_text())["hidden_size"]
    return np.load(BASE / "golden.npz")["input_ids"].size * hidden


def lora_model(ms, **kw):
    """The golden base with adapters (r 4, alpha 8, dropout 0, all seven targets); (model, trainable params)."""
    from finetune.io.hf_io import load_hf_config, load_weights
    from finetune.model.decoder import DecoderLM, ModelConfig
    from finetune.model.lora import apply_lora
    from jobspec.lora_config import LoraConfig

    model = DecoderLM(ModelConfig.from_dict(load_hf_config(BASE)))
    load_weights(model, BASE)
    params = apply_lora(model, LoraConfig(**{"r": 4, "alpha": 8, "dropout": 0.0, **kw}), seed=0)
    return model, params


def golden_init(ms, params) -> None:
    g = np.load(G)
    for p in params:
        p.set_data(ms.Tensor(g[f"init/{p.name}"], ms.float32))


def _batch(ms):
    g = np.load(BASE / "golden.npz")
    ids, labels = g["input_ids"].astype(np.int32), g["labels"].astype(np.int32)
    b, s = ids.shape
    pos, seg = np.tile(np.arange(s, dtype=np.int32), (b, 1)), np.ones((b, s), np.int32)
    return [ms.Tensor(x) for x in (ids, labels, pos, seg)], int((labels[:, 1:] != -100).sum())


def test_default_init_starts_at_the_base_model(ms_cpu):
    """peft's default init (B zero): step 0 gives the base model's logits."""
    model, params = lora_model(ms_cpu)
    base = np.load(BASE / "golden.npz")["logits"]
    np.testing.assert_allclose(model.logits(ms_cpu.Tensor(np.load(BASE / "golden.npz")["input_ids"].astype(np.int32)))
                               .asnumpy(), base, atol=1e-4, rtol=0)
    assert len(params) == 28 and all(p.name.endswith(".lora_B.weight") == (not p.asnumpy().any()) for p in params)


@pytest.mark.parametrize("compiled", [False, True])
def test_loss_gradients_and_adamw_step_equal_peft(ms_cpu, compiled):
    """Op by op and with each decoder layer one graph (train.compile_layers: on by default with dropout 0)."""
    ms = ms_cpu
    from finetune.dist import RankInfo
    from finetune.optim import AdamW
    from jobspec.config import TrainConfig

    g = np.load(G)
    model, params = lora_model(ms)
    if compiled:
        model.model.compile_layers()
    golden_init(ms, params)
    names = [p.name for p in params]
    assert len(names) == 28 and names == [k[5:] for k in g.files if k.startswith("init/")]
    assert not [p.name for p in model.trainable_params() if ".lora_" not in p.name]  # the base is frozen
    batch, n = _batch(ms)
    loss, grads = ms.value_and_grad(lambda *a: model(*a), None, params)(*batch)
    np.testing.assert_allclose(float(loss.asnumpy()) / n, float(g["loss"]), rtol=1e-5)
    for p, gr in zip(params, grads):
        assert_fp32_close(gr.asnumpy() / n, g[f"grad/{p.name}"], grad_terms(), err_msg=p.name)
    opt = AdamW(params, TrainConfig(lr=1e-2, betas=[0.9, 0.999], eps=1e-6, weight_decay=0.01, clip_grad=1.0),
                RankInfo())
    assert opt.params == params and len(opt.m) == 28  # optimizer state for the adapters only
    opt.step([gr / n for gr in grads], 1e-2)
    # Adam's first step is ~lr * g / (|g| + eps): an element whose gradient is near eps amplifies the last
    # bits of its gradient, so all elements agree to 0.5% of lr and nearly all to 1e-4 of it
    after = np.concatenate([p.asnumpy().ravel() for p in params])
    want = np.concatenate([g[f"step/{p.name}"].ravel() for p in params])
    np.testing.assert_allclose(after, want, rtol=1e-5, atol=5e-5)
    assert (np.abs(after - want) > 1e-6).mean() < 0.005


@pytest.mark.parametrize("kw,names", [({"target_modules": ["q_proj", "v_proj"]}, 8),
                                      ({"target_modules": [r".*\.1\.mlp\.(up|down)_proj"]}, 4),
                                      ({"modules_to_save": ["lm_head"]}, 29)])
def test_targets_and_modules_to_save(ms_cpu, kw, names):
    model, params = lora_model(ms_cpu, **kw)
    assert len(params) == names
    assert [p.name for p in model.trainable_params()] == [p.name for p in params]
    assert ("lm_head.weight" in [p.name for p in params]) == ("modules_to_save" in kw)


def test_dropout_acts_in_training_only(ms_cpu):
    ms = ms_cpu
    model, params = lora_model(ms, dropout=0.5)
    golden_init(ms, params)
    batch, n = _batch(ms)
    model.set_train(True)
    assert abs(float(model(*batch).asnumpy()) / n - float(np.load(G)["loss"])) > 1e-4
    model.set_train(False)
    np.testing.assert_allclose(float(model(*batch).asnumpy()) / n, float(np.load(G)["loss"]), rtol=1e-5)


def head_weight(model):
    return model.hf_state()["lm_head.weight" if model.lm_head is not None else "model.embed_tokens.weight"]


@pytest.mark.parametrize("saved", [[], ["lm_head"]])
def test_a_frozen_lm_head_gets_no_weight_gradient_matmul(ms_cpu, saved):
    """Issue 20 (speed): with the head frozen the backward skips its weight-gradient matmul (two of the
    three vocab-sized matmuls remain); with lm_head in modules_to_save it computes all three. The adapter
    gradients equal peft's either way (test above)."""
    ms = ms_cpu
    model, params = lora_model(ms, modules_to_save=saved)
    head = model.loss_fn
    calls = []
    real = head._gemm
    head._gemm = lambda *a, **k: calls.append(1) or real(*a, **k)
    model.set_train(True)
    batch, _ = _batch(ms)
    _, grads = ms.value_and_grad(lambda *a: model(*a), None, params)(*batch)
    assert head.weight_grad == bool(saved) and len(calls) == (3 if saved else 2)
    zero = head._weight_grad(None, head_weight(model))  # issue 30 item 7: a frozen head's gradient is one zero
    assert zero.shape == () and float(zero.asnumpy()) == 0.0
    if saved:
        assert float(np.abs(grads[-1].asnumpy()).max()) > 0  # lm_head's own gradient
