"""LoRA with the other training paths: recompute, gradient accumulation, packing, fp16 loss scaling and
the fused (Ascend) path under the CPU contract twins. Each gives peft's loss and adapter gradients
(tests/finetune/lora/golden, dropout 0) or equals the plain path on the same data."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file
from test_lora_golden import BASE, G, _batch, golden_init, grad_terms

from finetune.dist import RankInfo
from tests.finetune.contracts.conftest import twins  # noqa: F401  (the fixture: fused ops under their twins)
from tests.tolerances import assert_fp32_close

ASCEND = RankInfo(device_target="Ascend")


def _model(ms, rank: RankInfo = RankInfo(), recompute: bool = False):
    """The golden base with the golden adapters (r 4, alpha 8, dropout 0), built as the trainer does:
    adapters attached first, the layers recomputed after."""
    from finetune.io.hf_io import load_hf_config, load_weights
    from finetune.model.decoder import DecoderLM, ModelConfig
    from finetune.model.lora import apply_lora
    from jobspec.lora_config import LoraConfig

    model = DecoderLM(ModelConfig.from_dict(load_hf_config(BASE)), rank)
    load_weights(model, BASE, rank)
    params = apply_lora(model, LoraConfig(r=4, alpha=8, dropout=0.0), seed=0)
    if recompute:
        model.model.recompute_layers()
    golden_init(ms, params)
    model.set_train(True)
    return model, params


def _loss_grads(ms, model, params, batch):
    loss, grads = ms.value_and_grad(lambda *a: model(*a), None, params)(*batch)
    return float(loss.asnumpy()), [g.asnumpy() for g in grads]


def _equal_peft(loss, grads, params, n):
    g = np.load(G)
    np.testing.assert_allclose(loss / n, float(g["loss"]), rtol=1e-5)
    for p, gr in zip(params, grads):
        assert_fp32_close(gr / n, g[f"grad/{p.name}"], grad_terms(), err_msg=p.name)


def test_recompute_gives_peft_s_gradients(ms_cpu):
    """Layers recomputed after the adapters are attached: the adapters' gradients equal those without
    recompute (and peft's); attaching adapters to already recomputed layers (whose recompute cells would
    give them zero gradients) is refused."""
    batch, n = _batch(ms_cpu)
    model, params = _model(ms_cpu, recompute=True)
    assert all(layer.self_attn.q_proj.adapter is not None for layer in model.model.layers)
    loss, grads = _loss_grads(ms_cpu, model, params, batch)
    assert all(np.abs(gr).max() > 0 for gr in grads)
    _equal_peft(loss, grads, params, n)
    plain, pparams = _model(ms_cpu)
    ploss, pgrads = _loss_grads(ms_cpu, plain, pparams, batch)
    assert loss == pytest.approx(ploss, rel=1e-6)
    for a, b, p in zip(grads, pgrads, params):
        assert_fp32_close(a, b, grad_terms(), err_msg=p.name)
    from finetune.model.lora import apply_lora
    from jobspec.lora_config import LoraConfig

    with pytest.raises(ValueError, match="attach the adapters first, then model.model.recompute_layers"):
        apply_lora(model, LoraConfig(r=4, alpha=8, dropout=0.0), seed=0)


def test_gradient_accumulation_equals_one_big_batch(ms_cpu):
    """train.accumulate over one-row micro-batches sums to the two-row batch's gradients (peft's)."""
    from finetune.optim import AdamW
    from finetune.parallel.overlap import GradReduction
    from finetune.run.loop import accumulate
    from jobspec.config import TrainConfig

    ms = ms_cpu
    batch, n = _batch(ms)
    model, params = _model(ms)
    host = dict(zip(("input_ids", "labels", "position_ids", "segment_ids"), (x.asnumpy() for x in batch)))
    rows = host["input_ids"].shape[0]
    assert rows >= 2
    micro = [{k: v[i:i + 1] for k, v in host.items()} for i in range(rows)]
    grad_fn = ms.value_and_grad(lambda *a: model(*a[:4]) * a[4], None, params)
    opt = AdamW(params, TrainConfig(), RankInfo())
    buckets, loss = accumulate(grad_fn, micro, ms.Tensor(1.0 / n, ms.float32), GradReduction(params, opt, False))
    grads = [None] * len(params)
    for idx, bucket in zip(opt.bucket_params, buckets):  # the optimizer's buckets back to parameter order
        for i, g in zip(idx, bucket):
            grads[i] = g.asnumpy() * n
    _equal_peft(float(loss.asnumpy()) * n, grads, params, n)


def test_packed_rows_equal_the_sequences_apart(ms_cpu):
    """Two sequences packed into one row (segment ids, restarting positions) give the loss and adapter
    gradients of the two sequences in rows of their own."""
    ms = ms_cpu
    ids = np.load(BASE / "golden.npz")["input_ids"].astype(np.int32)
    a, b = ids[0, :9], ids[-1, :7]

    def row(*seqs, width=16):
        tok = np.concatenate(seqs)
        pad = width - len(tok)
        seg = np.concatenate([np.full(len(s), i + 1) for i, s in enumerate(seqs)] + [np.zeros(pad)])
        pos = np.concatenate([np.arange(len(s)) for s in seqs] + [np.zeros(pad)])
        lab = np.where(seg > 0, np.concatenate([tok, np.zeros(pad)]), -100)
        for end in np.cumsum([len(s) for s in seqs])[:-1]:
            lab[end] = -100  # a sequence's first token is never a target of the one before
        return [np.concatenate([tok, np.zeros(pad)]), lab, pos, seg]

    packed = [ms.Tensor(x[None].astype(np.int32)) for x in row(a, b)]
    apart = [ms.Tensor(np.stack([x, y]).astype(np.int32)) for x, y in zip(row(a), row(b))]
    model, params = _model(ms)
    loss_p, grads_p = _loss_grads(ms, model, params, packed)
    loss_a, grads_a = _loss_grads(ms, model, params, apart)
    assert loss_p == pytest.approx(loss_a, rel=1e-5)
    for x, y, p in zip(grads_p, grads_a, params):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6, err_msg=p.name)


def test_fused_path_under_the_twins_gives_peft_s_gradients(twins):  # noqa: F811 - the imported fixture
    """The Ascend path (fused RMSNorm, RoPE, SwiGLU under their contract twins) with adapters: peft's loss
    and every adapter gradient."""
    import mindspore as ms

    batch, n = _batch(ms)
    model, params = _model(ms, ASCEND)
    loss, grads = _loss_grads(ms, model, params, batch)
    _equal_peft(loss, grads, params, n)
    assert twins["rms_norm"] > 0 and twins["rotary_position_embedding"] > 0


@pytest.mark.slow  # a short training run (~40 s here)
def test_fp16_lora_scales_the_loss_and_skips_a_non_finite_step(tmp_path, capsys):
    """fp16 with the dynamic loss scale: a first scale so large the fp16 backward overflows skips that step
    (nothing applied, scale halved), as for full fine-tuning; the run goes on and finishes."""
    from test_lora_train import _recipe

    from finetune.run.loop import run

    out = tmp_path / "fp16"
    assert run(_recipe(out, **{"train.precision": "fp16", "train.max_steps": "4", "train.save_every": "0",
                               "train.loss_scale.initial": "1e30", "train.loss_scale.backoff_factor": "1e-25",
                               "export.dtype": "fp16", "export.check_prompts": ""})) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    scales = [r["loss_scale"] for r in records]  # the scale each step ran with
    assert scales[0] == pytest.approx(1e30, rel=1e-3) and not np.isfinite(records[0]["grad_norm"])
    assert scales[1:] == [pytest.approx(1e5, rel=1e-3)] * 3  # backed off once, after step 1
    assert all(np.isfinite(r["grad_norm"]) for r in records[1:])
    assert "1 step(s) up to step 1 skipped: non-finite gradients" in capsys.readouterr().out
    assert all(np.isfinite(r["loss"]) for r in records)
    assert json.loads((out / "hf" / "config.json").read_text())["torch_dtype"] == "float16"
    adapter = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert max(np.abs(a).max() for k, a in adapter.items() if ".lora_B." in k) > 0  # the good steps applied


def test_dropout_masks_are_keyed_and_recompute_draws_them_again(ms_cpu):
    """lora.dropout > 0: the same (step, micro-batch) gives the same masks, another micro-batch other ones;
    a recomputed layer draws its forward's masks again, and compiled layers read the same masks drawn
    ahead (LoraAdapter.draw), so their gradients equal the plain path's."""
    from finetune.io.hf_io import load_hf_config, load_weights
    from finetune.model.decoder import DecoderLM, ModelConfig
    from finetune.model.lora import apply_lora
    from jobspec.lora_config import LoraConfig

    ms = ms_cpu
    batch, _ = _batch(ms)
    runs = []
    rows = tuple(batch[0].shape)
    for path in ("plain", "recompute", "compiled"):
        model = DecoderLM(ModelConfig.from_dict(load_hf_config(BASE)))
        load_weights(model, BASE)
        if path == "compiled":  # before the adapters, as build_model does
            model.model.compile_layers()
        params = apply_lora(model, LoraConfig(r=4, alpha=8, dropout=0.3), seed=0)
        assert len(model.lora_masks.drawn) == (14 if path == "compiled" else 0)  # 2 layers x 7
        if path == "recompute":
            model.model.recompute_layers()
        golden_init(ms, params)
        model.set_train(True)
        model.lora_masks.advance(5, rows)
        runs.append(_loss_grads(ms, model, params, batch))
        model.lora_masks.advance(5, rows)  # the next micro-batch of step 5
        runs.append(_loss_grads(ms, model, params, batch))
    (l0, g0), (l1, g1), (l2, g2), (l3, _), (l4, g4), (l5, g5) = runs
    assert l0 != l1 and l0 == pytest.approx(l2, rel=1e-6) and l1 == pytest.approx(l3, rel=1e-6)
    assert l0 == pytest.approx(l4, rel=1e-6) and l1 == pytest.approx(l5, rel=1e-6)
    for a, b in zip(g1, g5):  # a graph rounds differently (fused ops): the compiled golden test's tolerance
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert l0 != pytest.approx(float(np.load(G)["loss"]) * _batch(ms)[1], rel=1e-4)  # the masks act
    late = DecoderLM(ModelConfig.from_dict(load_hf_config(BASE)))  # compiled after the adapters: refused
    apply_lora(late, LoraConfig(r=4, alpha=8, dropout=0.3), seed=0)
    with pytest.raises(ValueError, match="compile the layers first, then apply_lora"):
        late.model.compile_layers()
    for a, b, c in zip(g0, g2, g4):
        assert_fp32_close(a, b, grad_terms())
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("recompute", [False, True])
def test_fp16_fused_attention_with_adapters_equals_the_reference_path(twins, recompute):  # noqa: F811 - the imported fixture
    """fp16 packed rows on the Ascend path (TND flash attention under its twin, one call per layer) with
    adapters on all seven layers, recomputed or not: the loss and every adapter gradient equal the fp16
    reference path's."""
    import mindspore as ms

    from finetune.model.lora import apply_lora
    from jobspec.lora_config import LoraConfig
    from tests.finetune.contracts.test_ascend_path import _hd16_model, _loss_and_grads, _packed_batch

    results = []
    for rank in (ASCEND, RankInfo()):
        model = _hd16_model(rank, "float16")
        params = apply_lora(model, LoraConfig(r=4, alpha=8, dropout=0.0), seed=0)
        if recompute and rank is ASCEND:
            model.model.recompute_layers()
        rng = np.random.default_rng(11)
        for p in params:  # B away from zero, so A gets gradients too
            p.set_data(ms.Tensor(0.1 * rng.standard_normal(p.shape).astype(np.float32)))
        model.set_train(True)
        results.append(_loss_and_grads(ms, model, _packed_batch()))
    (loss_f, grads_f), (loss_r, grads_r) = results
    assert twins["flash_attention_score"] >= 2 and len(grads_r) == 28
    np.testing.assert_allclose(loss_f, loss_r, rtol=3e-2)
    for name, g in grads_r.items():
        assert np.abs(g).max() > 0, name
        np.testing.assert_allclose(grads_f[name], g, atol=3e-2 * np.abs(g).max(), rtol=0, err_msg=name)


@pytest.mark.parametrize("compiled", [False, True])
def test_eval_mode_applies_no_dropout_after_training_steps(ms_cpu, compiled):
    """Issue 31: after training steps with dropout (compiled layers: masks drawn ahead for the training batch's
    shape), eval mode applies no mask at all: the loss is peft's without dropout at the training shape, and
    generation (other shapes) runs."""
    from finetune.generate import Sampling, generate
    from finetune.io.hf_io import load_hf_config, load_weights
    from finetune.model.decoder import DecoderLM, ModelConfig
    from finetune.model.lora import apply_lora
    from jobspec.lora_config import LoraConfig

    ms = ms_cpu
    batch, n = _batch(ms)
    model = DecoderLM(ModelConfig.from_dict(load_hf_config(BASE)))
    load_weights(model, BASE)
    if compiled:
        model.model.compile_layers()
    params = apply_lora(model, LoraConfig(r=4, alpha=8, dropout=0.5), seed=0)
    golden_init(ms, params)
    model.set_train(True)
    model.lora_masks.advance(1, tuple(batch[0].shape))
    trained = _loss_grads(ms, model, params, batch)[0]
    assert abs(trained / n - float(np.load(G)["loss"])) > 1e-4  # the masks acted in training
    model.set_train(False)
    np.testing.assert_allclose(float(model(*batch).asnumpy()) / n, float(np.load(G)["loss"]), rtol=1e-5)
    out = generate(model, [[1, 2, 3], [4, 5]], set(), Sampling(temperature=0.0, max_new_tokens=3))
    assert [len(o) for o in out] == [3, 3]


def test_on_ascend_each_adapter_reseeds_one_generator_instead_of_making_one_per_forward(ms_cpu, monkeypatch):
    """Issue 30 item 7: the Ascend dropout path made a new ms.Generator per adapter per forward. Now each adapter
    makes one and seeds it again with the mask's key ((seed, step, micro-batch, module, rank): the same masks).
    mint.bernoulli (BernoulliExt, Ascend only) is a stand-in here that records the generator and its seed."""
    import mindspore as ms
    from mindspore import mint, ops

    from finetune.model.lora import LoraAdapter, MaskKey

    drawn = []

    def bernoulli(p, generator):
        drawn.append((id(generator), generator.initial_seed()))
        return ops.ones_like(p)

    monkeypatch.setattr(mint, "bernoulli", bernoulli)
    made = []
    real = ms.Generator
    monkeypatch.setattr(ms, "Generator", lambda: made.append(1) or real())
    masks = MaskKey(seed=3)
    base = type("Base", (), {"dtype": ms.float32})()
    a = ms.Parameter(ms.Tensor(np.ones((2, 4), np.float32)), name="a")
    b = ms.Parameter(ms.Tensor(np.ones((4, 2), np.float32)), name="b")
    adapter = LoraAdapter(a, b, 1.0, 0.1, True, base, RankInfo(device_target="Ascend"), masks, "m")
    adapter.set_train(True)
    x = ms.Tensor(np.ones((1, 3, 4), np.float32))
    keys = []
    for step in (0, 0, 1):
        masks.advance(step, (1, 3))
        keys.append(masks.of("m", adapter.rank_key))
        adapter(x)
    assert len(made) == 1 and len({g for g, _ in drawn}) == 1
    assert [seed for _, seed in drawn] == keys and len(set(keys)) == 3
