"""ZeRO-3's gathered layers in one process (DP 1, so a gather is the chunk itself): after ``release`` every decoder
layer's Parameters are one-element placeholders (the whole weights are freed), the loss and the gradients the
layers' backward hands to the reduction are the plain model's, ``on_host`` gives back exactly the weights on the rank
that keeps them and nothing on another, and ``nonfinite`` finds a NaN in a chunk.
The DP sums and the parity with one process over 20 steps are test_zero3_msrun.py's."""
import mindspore as ms
import numpy as np

from finetune.dist import RankInfo
from finetune.model.decoder import ModelConfig, DecoderLM
from finetune.optim import ShardedAdamW
from finetune.parallel.zero3 import Zero3Reduction, shard_layers
from jobspec.config import TrainConfig
from jobspec.tiny import tiny_config
from tests.tolerances import assert_fp32_close

SEQ = 16


def _model() -> DecoderLM:
    ms.set_seed(0)
    return DecoderLM(ModelConfig.from_dict(tiny_config({"vocab_size": 512})))


def _batch() -> list[ms.Tensor]:
    ids = np.random.default_rng(0).integers(0, 512, (2, SEQ)).astype(np.int32)
    pos = np.broadcast_to(np.arange(SEQ, dtype=np.int32), (2, SEQ)).copy()
    return [ms.Tensor(ids), ms.Tensor(ids), ms.Tensor(pos), ms.Tensor(np.ones((2, SEQ), np.int32))]


def assert_same_step(model, params: list, reduction, opt, plain, plain_params: list) -> None:
    """The loss and the reduced gradients of ``model`` (ZeRO-3's layers) are ``plain``'s (its ``plain_params``')."""
    loss, grads = ms.value_and_grad(model, None, reduction.taped(params))(*_batch())
    chunks = reduction.finish(list(grads))
    ref_loss, ref_grads = ms.value_and_grad(plain, None, plain_params)(*_batch())
    assert_fp32_close(loss.asnumpy(), ref_loss.asnumpy(), SEQ * 2)
    got = np.concatenate([c.asnumpy() for c in chunks])[:opt.layout.total]
    ref = np.concatenate([g.asnumpy().reshape(-1) for g in ref_grads])
    assert np.abs(ref).max() > 0
    assert_fp32_close(got, ref, SEQ * 2)


def test_gathered_layers_free_their_weights_and_give_the_plain_models_loss_and_gradients():
    ms.set_context(mode=ms.PYNATIVE_MODE)
    plain, model = _model(), _model()
    for a, b in zip(plain.trainable_params(), model.trainable_params()):
        b.set_data(a.copy())
    params = model.trainable_params()
    whole = {p.name: p.asnumpy().copy() for p in params}
    opt = ShardedAdamW(params, TrainConfig(), RankInfo())
    weights = shard_layers(model, opt, RankInfo())
    reduction = Zero3Reduction(params, opt, weights)
    weights.release()
    layer_params = [p for p in params if ".layers." in p.name]
    assert layer_params and all(int(np.prod(p.shape)) == 1 for p in layer_params)
    assert sorted(p.name for p in model.get_parameters()) == sorted(p.name for p in plain.get_parameters())

    assert_same_step(model, params, reduction, opt, plain, plain.trainable_params())
    assert all(int(np.prod(p.shape)) == 1 for p in layer_params)  # released again after the backward

    assert weights.nonfinite() == []
    with weights.on_host(keep=True):  # the rank writing the checkpoint: every layer whole, on the host
        for p in params:
            np.testing.assert_array_equal(p.asnumpy(), whole[p.name], err_msg=p.name)
    assert all(int(np.prod(p.shape)) == 1 for p in layer_params)
    with weights.on_host(keep=False):  # another rank: each layer gathered and released again
        assert all(int(np.prod(p.shape)) == 1 for p in layer_params)

    first = next(i for i, p in enumerate(params) if p is layer_params[0])
    k = weights.pieces[first][0][0]  # a bucket holding the first layer weight
    weights.chunks[k][0] = float("nan")
    assert layer_params[0].name in weights.nonfinite()
