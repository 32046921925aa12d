"""A trained tied embedding's gradient built in the LM head's d weight (``finetune.parallel.vocab.TiedGradient``):
the same bits as autodiff's sum of the head's and the lookup's dense gradients, one ``[vocab, hidden]`` buffer
where autodiff held three (docs/memory.md, ``tied``)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.finetune.test_model import GOLDEN, _build, _rows


def _grads(ms, model, batch) -> tuple[float, dict[str, np.ndarray]]:
    params = model.trainable_params()
    loss, grads = ms.value_and_grad(lambda *a: model(*a), None, params)(*(ms.Tensor(x) for x in batch))
    return float(loss.asnumpy()), {p.name: g.asnumpy().copy() for p, g in zip(params, grads)}


def _untie(model, monkeypatch) -> None:
    """The model as before TiedGradient: autodiff sums the head's and the lookup's gradients."""
    monkeypatch.setattr(model.loss_fn, "tied", None)
    monkeypatch.setattr(model.model.embed_tokens, "lookup", None)


@pytest.mark.parametrize("chunk,no_labels", [(0, False), (4, False), (0, True)])
def test_tied_gradient_is_autodiffs_sum_bit_for_bit(ms_cpu, chunk, no_labels, monkeypatch):
    """Repeated token ids (the lookup's rows summed per id), one or several loss chunks, and a micro-batch without
    labels (no head gradient: the lookup's rows alone)."""
    ms = ms_cpu
    model = _build(ms, GOLDEN / "tied")
    assert model.loss_fn.tied is not None and model.model.embed_tokens.lookup is not None
    model.loss_fn.chunk = chunk
    g = np.load(GOLDEN / "tied" / "golden.npz")
    ids, labels = g["input_ids"].astype(np.int32), g["labels"].astype(np.int32)
    ids[:, ::3] = ids[0, 1]  # one id many times
    if no_labels:
        labels[:] = -100
    batch = (ids, labels, *_rows(ids))
    loss, got = _grads(ms, model, batch)
    assert model.loss_fn.tied.head is None  # taken by the lookup's backward
    _untie(model, monkeypatch)
    ref_loss, ref = _grads(ms, model, batch)
    assert loss == ref_loss and got.keys() == ref.keys()
    assert (np.abs(ref["model.embed_tokens.weight"]).max() > 0) != no_labels  # no labels: zero loss, zero grads
    for name, r in ref.items():
        np.testing.assert_array_equal(got[name], r, err_msg=name)


def test_tied_gradient_only_on_the_host_with_the_whole_vocabulary(ms_cpu, tiny_hf_dir):
    """Untied: no TiedGradient; a frozen tied weight (LoRA) takes the plain lookup (no dense zero gradient)."""
    ms = ms_cpu
    untied = _build(ms, tiny_hf_dir("u", tie_word_embeddings=False))
    assert untied.loss_fn.tied is None and untied.model.embed_tokens.lookup is None
    tied = _build(ms, tiny_hf_dir("t", tie_word_embeddings=True))
    tied.model.embed_tokens.weight.requires_grad = False
    ids = np.arange(8, dtype=np.int32).reshape(1, 8)
    x = tied.model.embed_tokens(ms.Tensor(ids))
    np.testing.assert_array_equal(x.asnumpy()[0], tied.model.embed_tokens.weight.asnumpy()[:8])
