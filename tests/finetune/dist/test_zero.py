"""Sharded AdamW in one process: the math, partition sizes, layout checks.

Under real msrun workers it is exercised by test_msrun_train.py (DP=2: native all-gather on the
world group; TP=2 x DP=2: the AllReduce-based equivalents on DP sub-groups). ``toy_worker.py``
runs a toy model DP-sharded by hand: ``msrun ... toy_worker.py OUT 1 5 fallback``.
"""
import mindspore as ms
import numpy as np
import pytest
import toy_worker

from finetune.dist import RankInfo
from finetune.optim import AdamW, ShardedAdamW
from jobspec.layout import Layout
from jobspec.memory import shard_elements
from tests.tolerances import assert_fp32_close


def _run_in_process(opt_factory, steps=4):
    model = toy_worker.Toy()
    params = list(model.trainable_params())
    opt = opt_factory(params)
    grad_fn = ms.value_and_grad(model, None, params)
    rng = np.random.default_rng(1)
    losses = []
    for _ in range(steps):
        x = ms.Tensor(rng.integers(0, toy_worker.VOCAB, (8, 3)).astype(np.int32))
        y = ms.Tensor(rng.integers(0, toy_worker.CLASSES, (8,)).astype(np.int32))
        loss, grads = grad_fn(x, y)
        opt.step(grads, toy_worker.CFG.lr)
        losses.append(float(loss.asnumpy()))
    return losses, [p.asnumpy() for p in params]


def test_sharded_adamw_one_rank_equals_reference_adamw():
    """Same steps as the unsharded AdamW (torch-golden tested; the same in-place kernel) and as the
    float64-scalar numpy reference. MindSpore's AdamWeightDecay kernel forms 1 - beta2 in float32
    (9.99987e-4 for 0.999), so v's increments differ from the reference by ~1.3e-5 relative; Adam's
    normalised step makes that up to ~3e-5 (0.06% of lr) where a gradient is nearly zero."""
    ref_l, ref_w = _run_in_process(toy_worker.RefAdamW)
    adamw_l, adamw_w = _run_in_process(lambda ps: AdamW(ps, toy_worker.CFG, RankInfo()))
    got_l, got_w = _run_in_process(lambda ps: ShardedAdamW(ps, toy_worker.CFG, RankInfo(), bucket_bytes=200))
    np.testing.assert_allclose(got_l, adamw_l, rtol=1e-6)
    np.testing.assert_allclose(got_l, ref_l, rtol=1e-6)
    for a, b, ref in zip(got_w, adamw_w, ref_w):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(a, ref, rtol=1e-4, atol=1e-4)


def test_state_partition_matches_estimator_and_covers_everything():
    params = list(toy_worker.Toy().trainable_params())
    total = sum(int(np.prod(p.shape)) for p in params)
    for dp in (2, 4):
        sizes = [ShardedAdamW(params, toy_worker.CFG, RankInfo(world_size=dp, dp=dp, dp_rank=r, rank=r),
                              bucket_bytes=256) for r in range(dp)]
        sizes = [toy_worker.state_nbytes(opt) for opt in sizes]
        assert sizes == [shard_elements(total, dp, bucket_bytes=256) * 8] * dp
        assert total * 8 <= sum(sizes) <= total * 8 + dp * 8 * (total // 64 + 1)  # padding only


def test_layout_mismatch_on_load_names_the_fix():
    params = list(toy_worker.Toy().trainable_params())
    a = ShardedAdamW(params, toy_worker.CFG, RankInfo(world_size=2, dp=2, dp_rank=0))
    b = ShardedAdamW(params, toy_worker.CFG, RankInfo(world_size=2, dp=2, dp_rank=1))
    with pytest.raises(ValueError, match="parallel.dp"):
        b.load_state_dict(a.state_dict())


def test_low_precision_params_get_an_fp32_master_shard():
    params = [ms.Parameter(ms.Tensor(np.ones((6, 5), np.float16)), name="w16")]
    opt = ShardedAdamW(params, toy_worker.CFG, RankInfo(world_size=2, dp=2, dp_rank=1, rank=1))
    assert toy_worker.state_nbytes(opt) == 15 * 12 and opt.master[0].dtype == ms.float32
    assert {k.split(".")[1] for k in opt.state_dict() if k.startswith("shard.")} == {"layout", "master", "m", "v"}


def test_zero2_accumulates_the_chunks_of_each_micro_batch_as_zero1_the_whole_gradients():
    """One DP rank (a chunk is the whole bucket): ZeRO-2's chunk sums are ZeRO-1's reduced accumulator, bit for
    bit (the same fp32 adds), over three micro-batches, with and without the hooks; the micro-batch lists are
    emptied as read (each gradient dropped once reduced)."""
    from finetune.parallel.overlap import GradReduction, ShardedAccumulation, reduction_for

    params = list(toy_worker.Toy().trainable_params())
    opt = ShardedAdamW(params, toy_worker.CFG, RankInfo(), bucket_bytes=200)
    rng = np.random.default_rng(5)
    micro = [[rng.standard_normal(p.shape).astype(np.float32) for p in params] for _ in range(3)]

    def run(reduction):  # fresh tensors: ZeRO-1's accumulator adopts the first micro-batch's and adds into it
        acc = None
        for arrays in micro[:-1]:
            g = [ms.Tensor(a.copy()) for a in arrays]
            acc = reduction.add(acc, g)
            assert g == [] or all(x is None for x in g)
        reduction.arm(acc)
        return [c.asnumpy().copy() for c in reduction.finish([ms.Tensor(a.copy()) for a in micro[-1]])]

    zero1 = run(GradReduction(params, opt, overlap=False))
    zero2 = run(ShardedAccumulation(params, opt, overlap=False))
    layout = Layout(dp=2, shard_optimizer=True, shard_gradients=True)
    assert isinstance(reduction_for(params, opt, layout, RankInfo(), False), ShardedAccumulation)
    assert len(zero2) == len(opt.buckets) and layout.zero == 2
    for a, b in zip(zero2, zero1):
        np.testing.assert_array_equal(a, b)
    whole = np.concatenate([sum(m[i] for m in micro).reshape(-1) for i in range(len(params))])
    assert_fp32_close(np.concatenate(zero2)[:whole.size], whole, len(micro))  # the sums, whatever the add order


def test_zero2_keeps_a_bounded_number_of_reduce_scatters_in_flight():
    """Each reduce-scatter holds its bucket's flat fp32 copy until waited: ZeRO-2 waits for the oldest beyond
    IN_FLIGHT_BUCKETS as buckets launch (not all after the backward), with the same chunk sums bit for bit."""
    from finetune.parallel.overlap import ShardedAccumulation
    from jobspec.memory import IN_FLIGHT_BUCKETS

    params = list(toy_worker.Toy().trainable_params())
    opt = ShardedAdamW(params, toy_worker.CFG, RankInfo(), bucket_bytes=200)
    assert len(opt.buckets) > IN_FLIGHT_BUCKETS + 2
    rng = np.random.default_rng(6)
    micro = [[rng.standard_normal(p.shape).astype(np.float32) for p in params] for _ in range(2)]
    flying: set[int] = set()
    most = [0]

    class Flight:  # a collective in flight from launch to wait
        def __init__(self, k, inner):
            self.k, self.inner = k, inner
            flying.add(k)
            most[0] = max(most[0], len(flying))

        def wait(self):
            flying.discard(self.k)
            return self.inner.wait()

    def run():  # the gradients arrive last first, as a backward's hooks give them
        reduction = ShardedAccumulation(params, opt, overlap=False)
        acc = None
        for arrays in micro:
            grads = [ms.Tensor(a.copy()) for a in arrays]
            reduction.arm(acc)
            for i in reversed(range(len(grads))):
                reduction._arrive(i, grads[i])
            acc = reduction.add(acc, grads) if acc is None else reduction.finish(grads)
        return [c.asnumpy().copy() for c in acc]

    waited_at_the_end = run()
    launch = opt.launch
    opt.launch = lambda k, grads: Flight(k, launch(k, grads))
    bounded = run()
    assert most[0] == IN_FLIGHT_BUCKETS and not flying
    for a, b in zip(bounded, waited_at_the_end):
        np.testing.assert_array_equal(a, b)
