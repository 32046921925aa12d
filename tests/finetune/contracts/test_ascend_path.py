"""The model's Ascend path (fused kernels) on CPU under the contract twins: every fused call is
checked against its documented contract and the results equal the reference path and the
transformers goldens (fp32 and fp16, packed batches, the KV cache, the optimizer kernel)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from finetune.dist import RankInfo
from finetune.model.kernels import Packed

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
ASCEND = RankInfo(device_target="Ascend")
# head_dim 16 (flash attention needs a multiple of 16), GQA 4 query / 2 KV heads
HD16 = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0, "max_position_embeddings": 64}
HD16_QWEN3 = {**HD16, "model_type": "qwen3", "head_dim": 32}  # per-head q/k RMSNorm, head_dim != hidden/heads


def _golden_model(case: str, rank: RankInfo):
    from finetune.io.hf_io import load_hf_config, load_weights
    from finetune.model.decoder import DecoderLM, ModelConfig

    model = DecoderLM(ModelConfig.from_dict(load_hf_config(GOLDEN / case)), rank)
    load_weights(model, GOLDEN / case)
    return model


def _hd16_model(rank: RankInfo, dtype: str, config: dict = HD16):
    """The HD16 model (or ``config``) with seeded weights (std 0.1, norms 1 +- 0.1), its parameters in
    ``dtype`` as the trainer sets them for fp16/bf16."""
    import mindspore as ms

    from finetune.model.decoder import DecoderLM, ModelConfig

    model = DecoderLM(ModelConfig.from_dict(config), rank, compute_dtype=getattr(ms, dtype))
    rng = np.random.default_rng(7)
    for p in model.trainable_params():
        base = 1.0 if p.name.endswith("norm.weight") else 0.0
        p.set_data(ms.Tensor((base + 0.1 * rng.standard_normal(p.shape)).astype(np.float32)))
        if dtype != "float32":
            p.set_dtype(getattr(ms, dtype))
    return model


def _packed_batch():
    """Two rows of 16: two samples and padding in a row (restarting positions), one full row."""
    rng = np.random.default_rng(3)
    ids = rng.integers(0, HD16["vocab_size"], (2, 16)).astype(np.int32)
    seg = np.array([[1] * 7 + [2] * 6 + [0] * 3, [1] * 16], np.int32)
    pos = np.array([list(range(7)) + list(range(6)) + [0] * 3, list(range(16))], np.int32)
    labels = np.where(seg > 0, ids, -100).astype(np.int32)
    labels[0, 7] = -100
    return ids, labels, pos, seg


def _loss_and_grads(ms, model, batch):
    params = model.trainable_params()
    loss, grads = ms.value_and_grad(lambda *a: model(*a), None, params)(*(ms.Tensor(x) for x in batch))
    return float(loss.asnumpy()), {p.name: g.asnumpy().astype(np.float32) for p, g in zip(params, grads)}


@pytest.mark.parametrize("case", ["tied", "untied", "qwen3-tied", "qwen3-untied"])
def test_fp32_ascend_path_matches_transformers(twins, case):
    """fp32: fused RMSNorm, RoPE and SwiGLU (flash attention takes fp16/bf16 only: reference attention)."""
    ms = __import__("mindspore")
    g = np.load(GOLDEN / case / "golden.npz")
    model = _golden_model(case, ASCEND)
    ids, labels = g["input_ids"].astype(np.int32), g["labels"].astype(np.int32)
    np.testing.assert_allclose(model.logits(ms.Tensor(ids)).asnumpy(), g["logits"], atol=1e-4, rtol=0)
    pos = np.tile(np.arange(ids.shape[1], dtype=np.int32), (ids.shape[0], 1))
    loss, grads = _loss_and_grads(ms, model, (ids, labels, pos, np.ones_like(ids)))
    n = int((labels[:, 1:] != -100).sum())
    np.testing.assert_allclose(loss / n, float(g["loss"]), rtol=1e-5)
    for key in (k for k in g.files if k.startswith("grad/")):
        np.testing.assert_allclose(grads[key[5:]] / n, g[key], rtol=1e-4, atol=1e-5, err_msg=key)
    layers, norms = 2, 4 if case.startswith("qwen3") else 2  # Qwen3: + q_norm, k_norm per layer
    assert twins["rms_norm"] >= 2 * (norms * layers + 1) and twins["rotary_position_embedding"] >= 4 * layers
    assert twins["swiglu"] >= 2 * layers and "flash_attention_score" not in twins


@pytest.mark.parametrize("config", [HD16, HD16_QWEN3], ids=["qwen2", "qwen3"])
@pytest.mark.parametrize("dtype,tol", [("float32", 2e-5), ("float16", 3e-2)])
def test_packed_batch_ascend_path_equals_reference(twins, dtype, tol, config):
    """Packed rows: TND flash attention (fp16), sparse_mode 3, one call per layer; logits, loss and every
    gradient equal the reference path's (same weights, same dtype; Qwen3's q/k norms fused too)."""
    ms = __import__("mindspore")
    batch = _packed_batch()
    fused, ref = _hd16_model(ASCEND, dtype, config), _hd16_model(RankInfo(), dtype, config)
    args = [ms.Tensor(x) for x in (batch[0], batch[2], batch[3])]
    lf, lr = fused.logits(*args).asnumpy(), ref.logits(*args).asnumpy()
    scale = np.abs(lr).max()
    np.testing.assert_allclose(lf, lr, atol=tol * scale, rtol=0)
    assert twins.get("flash_attention_score", 0) == (2 if dtype == "float16" else 0)
    spec = fused.model._mask(args[2], 0, False)  # fp16: sequence ends, no [b, 1, s, s] mask
    assert isinstance(spec, Packed) == (dtype == "float16")
    if dtype == "float16":
        assert spec.ends == (7, 13, 16, 32)
    loss_f, grads_f = _loss_and_grads(ms, fused, batch)
    loss_r, grads_r = _loss_and_grads(ms, ref, batch)
    np.testing.assert_allclose(loss_f, loss_r, rtol=tol)
    for name, g in grads_r.items():
        np.testing.assert_allclose(grads_f[name], g, atol=tol * np.abs(g).max(), rtol=0, err_msg=name)


def test_fp16_packed_row_equals_separate_samples(twins):
    """Under TND, each packed sample sees only itself: same logits as the sample alone (and not
    the same as the row without segments)."""
    ms = __import__("mindspore")
    model = _hd16_model(ASCEND, "float16")
    ids, _, pos, seg = _packed_batch()
    packed = model.logits(*(ms.Tensor(x[:1]) for x in (ids, pos, seg))).asnumpy()[0].astype(np.float32)
    a, b = ids[:1, :7], ids[:1, 7:13]
    alone_a = model.logits(ms.Tensor(a)).asnumpy()[0].astype(np.float32)
    alone_b = model.logits(ms.Tensor(b)).asnumpy()[0].astype(np.float32)
    np.testing.assert_allclose(packed[:7], alone_a, atol=2e-2)
    np.testing.assert_allclose(packed[7:13], alone_b, atol=2e-2)
    plain = model.logits(ms.Tensor(ids[:1])).asnumpy()[0].astype(np.float32)
    assert np.abs(plain[7:13] - alone_b).max() > 0.1


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rms_norm_with_low_precision_weight(twins, dtype):
    """Issue 9 defect 1: the trainer makes norm weights bf16/fp16; the fused call must pass aclnnRmsNorm's
    dtype pairs (it passed fp32 x with a bf16 weight before)."""
    ms = __import__("mindspore")
    from finetune.model import kernels

    x = ms.Tensor(np.random.default_rng(0).standard_normal((2, 3, 32)).astype(np.float32)).astype(getattr(ms, dtype))
    w = ms.Tensor(np.linspace(0.5, 1.5, 32).astype(np.float32)).astype(getattr(ms, dtype))
    y = kernels.rms_norm(x, w, 1e-6, fused=True)
    assert y.dtype == x.dtype and twins["rms_norm"] == 1
    np.testing.assert_allclose(y.astype(ms.float32).asnumpy(),
                               kernels.rms_norm(x, w, 1e-6, fused=False).astype(ms.float32).asnumpy(), atol=3e-2)


def test_kv_cache_generation_on_the_ascend_path(twins):
    """fp16 with a KV cache: the prompt through flash attention (one sequence per row), the decode
    steps (S=1) through fused RoPE within its limits and reference attention; every step's logits
    equal the uncached reference logits."""
    ms = __import__("mindspore")
    fused, ref = _hd16_model(ASCEND, "float16"), _hd16_model(RankInfo(), "float16")
    tokens = [5, 17, 33, 2, 71, 9, 40, 11]
    full = ref.logits(ms.Tensor(np.array([tokens], np.int32))).asnumpy()[0].astype(np.float32)
    caches = fused.new_caches()
    got = [fused.last_logits(ms.Tensor(np.array([tokens[:5]], np.int32)), caches).asnumpy()[0]]
    assert twins["flash_attention_score"] == 2  # the prompt, one call per layer
    rope_calls = twins["rotary_position_embedding"]
    for t in tokens[5:]:
        got.append(fused.last_logits(ms.Tensor(np.array([[t]], np.int32)), caches).asnumpy()[0])
    assert twins["flash_attention_score"] == 2 and twins["rotary_position_embedding"] == rope_calls + 3 * 4
    np.testing.assert_allclose(np.array(got, np.float32), full[4:], atol=3e-2 * np.abs(full).max())


def test_rope_falls_back_outside_its_documented_sizes(twins):
    """B >= 1000 (a 1000-row decode step) is outside rotate_half's documented B < 1000: reference math."""
    ms = __import__("mindspore")
    from finetune.model import kernels

    x = ms.Tensor(np.random.default_rng(0).standard_normal((1000, 1, 2, 16)).astype(np.float16))
    cos = ms.Tensor(np.cos(np.arange(16) * 0.1).astype(np.float16).reshape(1, 1, 1, 16).repeat(1000, 0))
    sin = ms.Tensor(np.sin(np.arange(16) * 0.1).astype(np.float16).reshape(1, 1, 1, 16).repeat(1000, 0))
    y = kernels.rope(x, cos, sin, fused=True)
    assert "rotary_position_embedding" not in twins
    np.testing.assert_array_equal(y.asnumpy(), kernels.rope(x, cos, sin, fused=False).asnumpy())
    small = kernels.rope(x[:4], cos[:4], sin[:4], fused=True)
    assert twins["rotary_position_embedding"] == 1 and small.shape == (4, 1, 2, 16)


def test_optimizer_kernel_under_its_twin(twins):
    """The AdamW step (fp16 parameters with fp32 masters, as the trainer on Ascend) calls the optimizer
    kernel within its contract (fp32 w/m/v/grad, fp32 scalar hyper-parameters) and keeps what it returns:
    under the strict twin, which writes none of its inputs, every weight changes."""
    ms = __import__("mindspore")
    from finetune.optim import AdamW
    from jobspec.config import TrainConfig

    model = _hd16_model(ASCEND, "float16")
    _, grads = ms.value_and_grad(lambda *a: model(*a), None, model.trainable_params())(
        *(ms.Tensor(x) for x in _packed_batch()))
    before = {p.name: p.asnumpy().copy() for p in model.trainable_params()}
    opt = AdamW(model.trainable_params(), TrainConfig(lr=1e-2), ASCEND)
    _, applied = opt.step(grads, 1e-2)
    assert bool(applied.asnumpy()) and twins["adamw_update"] == len(before) and "AdamWeightDecay" not in twins
    assert all(not np.array_equal(p.asnumpy(), before[p.name]) for p in model.trainable_params())


@pytest.mark.parametrize("sharded", [False, True])
def test_a_skipped_step_calls_the_optimizer_kernel_within_its_contract(twins, sharded):
    """A step with non-finite gradients is skipped on the device by the same kernel call: its betas
    must stay in (0, 1) (betas of 1 were passed once), and weights and moments stay bit for bit as
    they were."""
    ms = __import__("mindspore")
    from finetune.optim import AdamW, ShardedAdamW
    from jobspec.config import TrainConfig

    model = _hd16_model(ASCEND, "float16")
    params = model.trainable_params()
    grad_fn = ms.value_and_grad(lambda *a: model(*a), None, params)
    _, grads = grad_fn(*(ms.Tensor(x) for x in _packed_batch()))
    cfg = TrainConfig(lr=1e-2)
    opt = ShardedAdamW(params, cfg, ASCEND, bucket_bytes=4096) if sharded else AdamW(params, cfg, ASCEND)
    opt.step(grads, 1e-2)
    weights = [p.asnumpy().copy() for p in params]
    state = {k: v.copy() for k, v in opt.state_dict().items()}
    bad = [g * float("nan") if i == 3 else g for i, g in enumerate(grads)]
    _, applied = opt.step(bad, 1e-2)
    assert not bool(applied.asnumpy())
    for p, w in zip(params, weights):
        np.testing.assert_array_equal(p.asnumpy(), w, err_msg=p.name)
    after = opt.state_dict()
    assert after.keys() == state.keys()
    for k in state:
        np.testing.assert_array_equal(after[k], state[k], err_msg=k)


def test_recomputed_layers_on_the_ascend_path(twins):
    """train.recompute with TND flash attention: every gradient equals the one without recompute (a
    Tensor in the attention spec, an argument of the recomputed layer, once shifted the gradients
    onto the wrong parameters)."""
    ms = __import__("mindspore")
    from finetune.model.decoder import DecoderLM, ModelConfig

    plain = _hd16_model(ASCEND, "float16")
    recomputed = DecoderLM(ModelConfig.from_dict(HD16), ASCEND, recompute=True, compute_dtype=ms.float16)
    for p, q in zip(recomputed.trainable_params(), plain.trainable_params()):
        p.set_data(q.astype(ms.float32))
        p.set_dtype(ms.float16)
    loss_r, grads_r = _loss_and_grads(ms, recomputed, _packed_batch())
    loss_p, grads_p = _loss_and_grads(ms, plain, _packed_batch())
    assert loss_r == loss_p and twins["flash_attention_score"] >= 4
    for name, g in grads_p.items():
        np.testing.assert_array_equal(grads_r[name], g, err_msg=name)


def test_packed_spec_comes_from_the_host_batch_not_the_device(twins):
    """Issue 12 item 8: the training step builds the TND spec from the loader's numpy segment ids
    (trainer.batch_tensors), never reading the segment tensor back from the NPU; a segment tensor
    without its host array is read (the old path, a device sync per micro-batch)."""
    ms = __import__("mindspore")
    from finetune.run.training import BATCH_KEYS, batch_tensors

    model = _hd16_model(ASCEND, "float16")
    mb = dict(zip(BATCH_KEYS, _packed_batch()))

    def device_read():
        raise AssertionError("segment_ids read from the device")

    tensors = batch_tensors(mb)
    tensors[-1].asnumpy = device_read
    loss, _ = ms.value_and_grad(lambda *a: model(*a), None, model.trainable_params())(*tensors)
    assert np.isfinite(float(loss.asnumpy())) and twins["flash_attention_score"] >= 2
    del tensors[-1].host
    with pytest.raises(AssertionError, match="read from the device"):
        model(*tensors)


@pytest.mark.parametrize("on_device", [True, False])
def test_adamw_matches_torch_under_the_strict_kernel_twin(twins, on_device):
    """Issue 18 section 1.3: with a kernel that returns new tensors and writes none of its inputs (the
    twin), AdamW still equals torch's AdamW (tools/make_optim_golden.py), on both step gates. The old
    optimizer relied on ops.AdamWeightDecay writing its inputs in place and learned nothing here."""
    import json

    ms = __import__("mindspore")
    from finetune.optim import AdamW
    from jobspec.config import TrainConfig

    golden = json.loads((GOLDEN / "adamw.json").read_text())
    params = [ms.Parameter(ms.Tensor(np.array(golden["init"][k], np.float32)), name=k) for k in ("w", "b")]
    opt = AdamW(params, TrainConfig(lr=1e-2, clip_grad=1.0), RankInfo())
    opt.gate.on_device = on_device
    opt.gate.in_place = False  # the composed kernel on both gates (CPU's in-place one: test_optim.py)
    for g, lr in zip(golden["grads"], golden["lrs"]):
        opt.step(tuple(ms.Tensor(np.array(g[k], np.float32)) for k in ("w", "b")), lr)
    assert twins["adamw_update"] == 2 * len(golden["grads"])
    for p, k in zip(params, ("w", "b")):
        np.testing.assert_allclose(p.asnumpy(), np.array(golden["final"][k]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sharded", [False, True])
def test_an_update_that_reaches_no_weight_stops_the_run(twins, monkeypatch, sharded):
    """The runtime guard (optim.UpdateCheck): a kernel whose results do not reach the weights (here one
    that returns its inputs, as a write-nothing kernel looks to a caller relying on in-place writes)
    fails at the first check after an applied step, saying what it means; a working one passes."""
    ms = __import__("mindspore")
    from finetune import optim
    from finetune.optim import ShardedAdamW, update
    from jobspec.config import TrainConfig

    def run(kernel):
        if kernel is not None:
            monkeypatch.setattr(update, "adamw_update", kernel)
        model = _hd16_model(ASCEND, "float16")
        params = model.trainable_params()
        _, grads = ms.value_and_grad(lambda *a: model(*a), None, params)(*(ms.Tensor(x) for x in _packed_batch()))
        cfg = TrainConfig(lr=1e-2, weight_decay=0.0)  # the sharded decay of mixed chunks is outside the kernel
        opt = ShardedAdamW(params, cfg, ASCEND, bucket_bytes=4096) if sharded else optim.AdamW(params, cfg, ASCEND)
        check = optim.UpdateCheck(opt, cfg.lr)
        check.verify(0)  # nothing applied yet: nothing to say
        opt.step(grads, 1e-2)
        check.verify(1)

    run(None)  # the strict twin: the weights change
    with pytest.raises(RuntimeError, match=r"applied 1 step\(s\) up to step 1 but no master weight changed.*"
                                           r"loss would stay flat.*make selftest"):
        run(lambda w, m, v, g, k, wd: (w, m, v))
