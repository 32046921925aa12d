"""Qwen2 / Qwen3 model: parity with Hugging Face transformers (goldens from tools/make_golden.py), packing."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

GOLDEN = Path(__file__).resolve().parent / "golden"


def _build(ms_cpu, model_dir, **kw):
    from finetune.io.hf_io import load_hf_config, load_weights
    from finetune.model.decoder import DecoderLM, ModelConfig

    model = DecoderLM(ModelConfig.from_dict(load_hf_config(model_dir)), **kw)
    load_weights(model, model_dir)
    return model


@pytest.fixture(scope="module")
def golden_model(ms_cpu):
    """golden_model("tied" | "untied"): the loaded golden model, built once per module."""
    cache: dict = {}

    def get(case: str):
        if case not in cache:
            cache[case] = _build(ms_cpu, GOLDEN / case)
        return cache[case]

    return get


def _rows(ids):
    b, s = ids.shape
    return np.tile(np.arange(s, dtype=np.int32), (b, 1)), np.ones((b, s), np.int32)


@pytest.mark.parametrize("host_gemm", [True, False])
@pytest.mark.parametrize("case,chunk", [("tied", 0), ("untied", 0), ("tied", 4), ("untied", 7), ("qwen3-tied", 0),
                                        ("qwen3-untied", 0), ("qwen3-tied", 5)])
def test_matches_transformers(ms_cpu, golden_model, case, chunk, host_gemm, monkeypatch):
    """chunk > 0: the LM head + loss over chunks of that many label tokens (train.loss_chunk_tokens).
    host_gemm: the head's vocab-sized matmuls in numpy's BLAS and its softmax in numpy (CPU's default), or
    MindSpore's MatMul and softmax (every other device's)."""
    ms = ms_cpu
    g = np.load(GOLDEN / case / "golden.npz")
    model = golden_model(case)
    assert model.loss_fn.host_gemm  # CPU, fp32
    monkeypatch.setattr(model.loss_fn, "chunk", chunk)
    monkeypatch.setattr(model.loss_fn, "host_gemm", host_gemm)
    assert len(model.loss_fn._chunks(int((g["labels"][:, 1:] != -100).sum()))) > (1 if chunk else 0)
    assert ("lm_head.weight" in model.hf_state()) == case.endswith("untied")
    ids, labels = g["input_ids"].astype(np.int32), g["labels"].astype(np.int32)
    pos, seg = _rows(ids)
    logits = model.logits(ms.Tensor(ids)).asnumpy()
    np.testing.assert_allclose(logits, g["logits"], atol=1e-4, rtol=0)

    params = model.trainable_params()
    fn = ms.value_and_grad(lambda *a: model(*a), None, params)
    loss_sum, grads = fn(*(ms.Tensor(x) for x in (ids, labels, pos, seg)))
    n = int((labels[:, 1:] != -100).sum())
    assert loss_sum.dtype == ms.float32 and loss_sum.shape == ()
    np.testing.assert_allclose(float(loss_sum.asnumpy()) / n, float(g["loss"]), rtol=1e-5)
    by_name = {p.name: gr.asnumpy() / n for p, gr in zip(params, grads)}
    for key in g.files:
        if key.startswith("grad/"):
            np.testing.assert_allclose(by_name[key[5:]], g[key], rtol=1e-4, atol=1e-5, err_msg=key)
    norm = np.sqrt(sum(float((v.astype(np.float64) ** 2).sum()) for v in by_name.values()))
    np.testing.assert_allclose(norm, float(g["grad_norm"]), rtol=1e-4)


def test_the_head_uses_host_blas_only_on_cpu_in_fp32(ms_cpu):
    """numpy's BLAS reads the tensors' memory: only where that memory is the host's and the
    compute dtype is one numpy multiplies fast (fp32); bf16 and Ascend keep MindSpore's MatMul."""
    ms = ms_cpu
    from finetune.dist import RankInfo
    from finetune.parallel.vocab import LMHeadCrossEntropy

    assert LMHeadCrossEntropy(ms.float32, RankInfo()).host_gemm
    assert not LMHeadCrossEntropy(ms.bfloat16, RankInfo()).host_gemm
    assert not LMHeadCrossEntropy(ms.float16, RankInfo()).host_gemm
    assert not LMHeadCrossEntropy(ms.float32, RankInfo(device_target="Ascend")).host_gemm


@pytest.mark.parametrize("chunk,training,logit_matmuls", [(0, True, 1), (0, False, 2), (7, True, 2)])
def test_one_chunk_keeps_its_logits_for_the_backward(ms_cpu, golden_model, chunk, training, logit_matmuls,
                                                     monkeypatch):
    """Issue 12 (speed): in training mode one chunk computes the vocab-sized logits once for forward and
    backward (the backward recomputed them before: 4 vocab matmuls, torch does 3); over several chunks,
    or in eval mode (no backward expected), each chunk's are recomputed. Same gradients either way
    (the goldens test above)."""
    ms = ms_cpu
    g = np.load(GOLDEN / "untied" / "golden.npz")
    model = golden_model("untied")
    head = model.loss_fn
    monkeypatch.setattr(head, "chunk", chunk)
    calls = []
    real = head._logits
    monkeypatch.setattr(head, "_logits", lambda h, w: calls.append(h.shape[0]) or real(h, w))
    ids, labels = g["input_ids"].astype(np.int32), g["labels"].astype(np.int32)
    fn = ms.value_and_grad(lambda *a: model(*a), None, model.trainable_params())
    model.set_train(training)
    try:
        fn(*(ms.Tensor(x) for x in (ids, labels, *_rows(ids))))
        chunks = len(head._chunks(int((labels[:, 1:] != -100).sum())))
        assert len(calls) == chunks * logit_matmuls and head.kept is None
        model(*(ms.Tensor(x) for x in (ids, labels, *_rows(ids))))  # a forward alone
        assert (head.kept is not None) == (training and chunk == 0)
    finally:
        model.set_train(False)
        head.kept = None


def test_the_host_softmax_writes_the_gradient_over_the_kept_logits(ms_cpu):
    """CPU's cross-entropy gradient by the logits (softmax - onehot) is computed in place over the logits the
    forward kept (no second [tokens, vocab] buffer); logits without memory of their own are copied first."""
    ms = ms_cpu
    from mindspore import ops

    from finetune.parallel.vocab import host_row_sums, host_softmax_minus_onehot

    rng = np.random.default_rng(0)
    x, t = rng.standard_normal((37, 1000)).astype(np.float32) * 4, rng.integers(0, 1000, 37).astype(np.int32)
    want = ops.softmax(ms.Tensor(x), -1).asnumpy()
    want[np.arange(37), t] -= 1
    logits = ops.add(ms.Tensor(x), 0.0)
    address = logits.data_ptr()
    top, total = sums = host_row_sums(logits.asnumpy())
    np.testing.assert_allclose(np.log(total) + top, np.log(np.exp(x.astype(np.float64)).sum(1)), rtol=1e-6)
    p = host_softmax_minus_onehot(logits, t, sums)
    assert p is logits and p.data_ptr() == address
    np.testing.assert_allclose(p.asnumpy(), want, atol=1e-6)
    whole = ms.Tensor(np.concatenate([x, x]))
    view = whole[37:]
    np.testing.assert_allclose(host_softmax_minus_onehot(view, t, None).asnumpy(), want, atol=1e-6)
    np.testing.assert_array_equal(whole.asnumpy()[37:], x)  # the view's storage is left alone


def test_packed_row_equals_separate_samples(ms_cpu, golden_model):
    """Two samples packed in one row (segments, restarting positions, padding) = each alone."""
    ms = ms_cpu
    model = golden_model("untied")
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 256, 7).astype(np.int32), rng.integers(0, 256, 5).astype(np.int32)
    row = np.concatenate([a, b, [0, 0]]).astype(np.int32)[None]
    pos = np.concatenate([np.arange(7), np.arange(5), [0, 0]]).astype(np.int32)[None]
    seg = np.array([[1] * 7 + [2] * 5 + [0, 0]], np.int32)
    packed = model.logits(ms.Tensor(row), ms.Tensor(pos), ms.Tensor(seg)).asnumpy()[0]
    alone_a = model.logits(ms.Tensor(a[None])).asnumpy()[0]
    alone_b = model.logits(ms.Tensor(b[None])).asnumpy()[0]
    np.testing.assert_allclose(packed[:7], alone_a, atol=1e-5)
    np.testing.assert_allclose(packed[7:12], alone_b, atol=1e-5)
    # without segments the second sample would see the first: the test can tell the difference
    plain = model.logits(ms.Tensor(row)).asnumpy()[0]
    assert np.abs(plain[7:12] - alone_b).max() > 1e-3

    # the loss over the packed row is the sum of the per-sample losses
    lab = row.copy()
    lab[0, 12:] = -100
    lab[0, 7] = -100  # the first token of sample b has no prediction from sample a
    packed_loss = model(*(ms.Tensor(x) for x in (row, lab, pos, seg))).asnumpy()
    sep = sum(model(ms.Tensor(x[None]), ms.Tensor(x[None]), *(ms.Tensor(t) for t in _rows(x[None]))).asnumpy()
              for x in (a, b))
    np.testing.assert_allclose(packed_loss, sep, rtol=1e-5)


@pytest.mark.parametrize("case", ["tied", "qwen3-untied"])
def test_recompute_keeps_gradients(ms_cpu, case):
    ms = ms_cpu
    g = np.load(GOLDEN / case / "golden.npz")
    ids, labels = g["input_ids"].astype(np.int32), g["labels"].astype(np.int32)
    model = _build(ms, GOLDEN / case, recompute=True)
    params = model.trainable_params()
    _, grads = ms.value_and_grad(lambda *a: model(*a), None, params)(
        *(ms.Tensor(x) for x in (ids, labels, *_rows(ids))))
    n = int((labels[:, 1:] != -100).sum())
    by_name = {p.name: gr.asnumpy() / n for p, gr in zip(params, grads)}
    for key in g.files:
        if key.startswith("grad/"):
            np.testing.assert_allclose(by_name[key[5:]], g[key], rtol=1e-4, atol=1e-5, err_msg=key)


def test_config_from_dict_reads_hf_variants():
    from finetune.model.decoder import ModelConfig

    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "unknown_hf_key": 1}
    cfg = ModelConfig.from_dict({**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}})
    assert cfg.rope_theta == 5e5 and cfg.num_key_value_heads == 2 and cfg.head_dim == 4
    assert ModelConfig.from_dict({**base, "rope_theta": 1e4, "tie_word_embeddings": True}).tie_word_embeddings
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_dict({k: v for k, v in base.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_dict({**base, "rope_scaling": {"type": "yarn", "factor": 4}})


@pytest.mark.parametrize("model_type,arch", [("llama", "LlamaForCausalLM"), ("qwen2_moe", "Qwen2MoeForCausalLM"),
                                             ("qwen3_moe", "Qwen3MoeForCausalLM"),
                                             ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
                                             ("qwen3", "Qwen2ForCausalLM")])
def test_config_of_another_family_is_refused_naming_what_is_supported(model_type, arch):
    from finetune.model.decoder import ModelConfig

    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2}
    with pytest.raises(ValueError, match=f"model_type '{model_type}' \\({arch}\\) is not supported.*Qwen3ForCausalLM"):
        ModelConfig.from_dict({**base, "model_type": model_type, "architectures": [arch]})
    coder = ModelConfig.from_dict({**base, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]})
    assert coder.model_type == "qwen2"  # Qwen2.5-Coder / -Math
    assert ModelConfig.from_dict({**base, "architectures": ["Qwen3ForCausalLM"]}).model_type == "qwen3"
    with pytest.raises(ValueError, match="attention_bias true is not supported for model_type 'qwen3'"):
        ModelConfig.from_dict({**base, "model_type": "qwen3", "attention_bias": True})


def test_half_compute_dtype_keeps_fp32_masters_and_loss(ms_cpu):
    """compute_dtype (bf16 on Ascend; fp16 here, CPU has no bf16 matmul) casts inside matmuls only."""
    ms = ms_cpu
    g = np.load(GOLDEN / "untied" / "golden.npz")
    model = _build(ms, GOLDEN / "untied", compute_dtype=ms.float16)
    assert all(p.dtype == ms.float32 for p in model.trainable_params())
    ids, labels = g["input_ids"].astype(np.int32), g["labels"].astype(np.int32)
    logits = model.logits(ms.Tensor(ids))
    assert logits.dtype == ms.float32
    np.testing.assert_allclose(logits.asnumpy(), g["logits"], atol=3e-2)
    loss = model(*(ms.Tensor(x) for x in (ids, labels, *_rows(ids))))
    n = int((labels[:, 1:] != -100).sum())
    assert loss.dtype == ms.float32
    np.testing.assert_allclose(float(loss.asnumpy()) / n, float(g["loss"]), rtol=1e-2)


def test_batch_without_labels_gives_zero_loss_and_grads(ms_cpu, golden_model):
    ms = ms_cpu
    model = golden_model("untied")
    ids = np.arange(12, dtype=np.int32).reshape(2, 6)
    labels = np.full_like(ids, -100)
    labels[:, 0] = 5  # a label on the first position has nothing predicting it
    loss, grads = ms.value_and_grad(lambda *a: model(*a), None, model.trainable_params())(
        *(ms.Tensor(x) for x in (ids, labels, *_rows(ids))))
    assert float(loss.asnumpy()) == 0.0
    assert all(not np.abs(g.asnumpy()).any() for g in grads)


@pytest.mark.parametrize("case", ["tied", "untied"])
def test_cast_params_keeps_a_tied_embedding_fp32(ms_cpu, case):
    ms = ms_cpu
    model = _build(ms, GOLDEN / case)
    model.cast_params(ms.float32)
    assert all(p.dtype == ms.float32 for p in model.trainable_params())
    model.cast_params(ms.float16)
    dtypes = {p.name: p.dtype for p in model.trainable_params()}
    assert dtypes.pop("model.embed_tokens.weight") == (ms.float32 if case == "tied" else ms.float16)
    assert set(dtypes.values()) == {ms.float16}
    g = np.load(GOLDEN / case / "golden.npz")  # still computes: both gradient paths of a tied embedding agree
    ids, labels = g["input_ids"].astype(np.int32), g["labels"].astype(np.int32)
    loss, grads = ms.value_and_grad(lambda *a: model(*a), None, model.trainable_params())(
        *(ms.Tensor(x) for x in (ids, labels, *_rows(ids))))
    n = int((labels[:, 1:] != -100).sum())
    np.testing.assert_allclose(float(loss.asnumpy()) / n, float(g["loss"]), rtol=1e-2)
