"""An untied embedding's gradient accumulated over micro-batches as its rows (``finetune.parallel.vocab.RowGradient``):
the same bits as the dense fp32 accumulator's sums, and no ``[vocab, hidden]`` gradient before the step's last
backward (docs/memory.md, ``accumulator``)."""
from __future__ import annotations

import numpy as np
import pytest

from finetune.dist import RankInfo
from finetune.optim import AdamW
from finetune.parallel.overlap import GradReduction, ShardedAccumulation
from finetune.parallel.vocab import RowGradient
from jobspec.config import TrainConfig
from tests.finetune.test_model import GOLDEN, _build, _rows

EMBED = "model.embed_tokens.weight"


def test_rows_sum_as_the_dense_accumulator_does():
    rng = np.random.default_rng(0)
    grad, dense = RowGradient(), np.zeros((10, 3), np.float32)
    for ids in ([4, 1, 4], [2, 9], [1, 2, 7]):
        rows, sums = np.unique(ids), rng.standard_normal((len(set(ids)), 3)).astype(np.float32)
        grad.add(rows, sums)
        part = np.zeros_like(dense)
        part[rows] = sums
        dense = dense + part
    np.testing.assert_array_equal(grad.take((10, 3)), dense)
    assert grad.sums is None and grad.rows.size == 0  # dropped once taken
    np.testing.assert_array_equal(grad.take((10, 3)), np.zeros((10, 3), np.float32))


def _micro_batches(n: int) -> list[dict[str, np.ndarray]]:
    g = np.load(GOLDEN / "untied" / "golden.npz")
    out = []
    for k in range(n):
        ids = np.roll(g["input_ids"].astype(np.int32), k, axis=1)
        ids[:, ::3] = ids[0, 1 + k]  # one id many times, another id in each micro-batch
        pos, seg = _rows(ids)
        out.append({"input_ids": ids, "labels": np.roll(g["labels"].astype(np.int32), k, axis=1),
                    "position_ids": pos, "segment_ids": seg})
    return out


@pytest.mark.parametrize("grad_accum,overlap,dtype", [(3, False, "float32"), (3, True, "float32"),
                                                      (1, True, "float32"), (3, True, "float16"),
                                                      (1, False, "float16")])
def test_the_embeddings_rows_give_the_dense_accumulators_bits(ms_cpu, monkeypatch, grad_accum, overlap, dtype):
    """``accumulate`` with the rows (the step's last backward returns their dense sum, the earlier ones a view of
    one zero) against autodiff's dense gradients cast to fp32 and summed in micro-batch order: equal bit for bit,
    every parameter; with one micro-batch the lookup's own gradient in fp32. In fp16 the weights are fp16 and each
    micro-batch's rows are summed in fp16, as autodiff's IndexSelect gradient sums them."""
    ms = ms_cpu
    import finetune.run.loop as loop

    model = _build(ms, GOLDEN / "untied", compute_dtype=getattr(ms, dtype))
    model.cast_params(getattr(ms, dtype))
    emb = model.model.embed_tokens
    assert emb.row_lookup is not None and emb.weight.row_grad.mode == "off"
    params = model.trainable_params()
    names = [p.name for p in params]
    keys = ("input_ids", "labels", "position_ids", "segment_ids")
    monkeypatch.setattr(loop, "batch_tensors", lambda mb: [ms.Tensor(mb[k]) for k in keys])
    grad_fn = ms.value_and_grad(lambda ids, labels, pos, seg, scale: model(ids, labels, pos, seg) * scale, None,
                                params)
    batches, scale = _micro_batches(grad_accum), ms.Tensor(0.25, ms.float32)
    ref = None
    for mb in batches:  # the lookup's own dense gradient ("off"), summed as the dense accumulator does
        parts = [g.asnumpy().astype(np.float32) for g in grad_fn(*loop.batch_tensors(mb), scale)[1]]
        ref = parts if ref is None else [r + p for r, p in zip(ref, parts)]
    shapes: list[tuple] = []

    def recording(*args):
        loss, g = grad_fn(*args)
        e = g[names.index(EMBED)]
        shapes.append((tuple(e.shape), e.is_contiguous()))  # not contiguous: a view of one zero
        return loss, g

    reduction = GradReduction(params, AdamW(params, TrainConfig(), RankInfo()), overlap)
    assert list(reduction.by_rows) == [names.index(EMBED)] and emb.weight.row_grad.mode == "rows"
    buckets, _ = loop.accumulate(recording, batches, scale, reduction)
    got = [g for b in buckets for g in b]
    assert shapes == [(tuple(emb.weight.shape), False)] * (grad_accum - 1) + [(tuple(emb.weight.shape), True)]
    assert np.abs(ref[names.index(EMBED)]).max() > 0
    for name, g, r in zip(names, got, ref):
        np.testing.assert_array_equal(g.asnumpy(), r, err_msg=name)
    assert emb.weight.row_grad.mode == "rows" and emb.weight.row_grad.sums is None  # ready for the next step


def test_zero2_takes_every_micro_batchs_dense_gradient(ms_cpu):
    """ZeRO-2/3 reduce-scatter each micro-batch's whole gradients: the rows stay off there."""
    ms = ms_cpu
    model = _build(ms, GOLDEN / "untied")
    params = model.trainable_params()
    reduction = ShardedAccumulation(params, AdamW(params, TrainConfig(), RankInfo()), False)
    assert reduction.by_rows == {} and model.model.embed_tokens.weight.row_grad.mode == "off"
