"""GradReduction in one process: bucket launch order and the error a broken hook contract gives."""
import mindspore as ms
import numpy as np
import pytest

from finetune.collectives import Ready
from finetune.parallel.overlap import GradReduction


class Buckets:
    """An optimizer's bucket interface that records the launches (no collective)."""

    bucket_params = [[0], [1, 2], [2]]

    def __init__(self):
        self.launched = []

    def launch(self, k, grads):
        self.launched.append(k)
        return Ready([grads[i] for i in self.bucket_params[k]])


def _params():
    return [ms.Parameter(ms.Tensor(np.ones(2, np.float32)), name=f"p{i}") for i in range(3)]


def test_buckets_start_last_first_whatever_order_the_gradients_arrive_in():
    opt = Buckets()
    red = GradReduction(_params(), opt, overlap=True)
    red.arm(None)
    g = [ms.Tensor(np.full(2, i, np.float32)) for i in range(3)]
    red._hook(1)(g[1])
    red._hook(0)(g[0])  # bucket 0 is complete, but buckets 2 and 1 must start first
    assert opt.launched == []
    red._hook(2)(g[2])
    assert opt.launched == [2, 1, 0] and red.launched_after == [3, 3, 3]
    out = red.finish(g)
    assert [[float(x.asnumpy()[0]) for x in b] for b in out] == [[0.0], [1.0, 2.0], [2.0]]


def test_a_hook_that_fires_twice_is_refused_naming_the_parameter_and_the_fix():
    red = GradReduction(_params(), Buckets(), overlap=True)
    red.arm(None)
    red._hook(1)(ms.Tensor(np.ones(2, np.float32)))
    with pytest.raises(RuntimeError, match=r"p1 ran twice.*OVERRIDES='parallel.overlap_grad_reduce=false'"):
        red._hook(1)(ms.Tensor(np.ones(2, np.float32)))


def test_the_hooks_return_the_gradient_and_backward_runs_under_the_hook_twin(monkeypatch):
    """Issue 18 section 1.4: MindSpore 2.10's Tensor.register_hook says a hook returns the gradient,
    never None (the old hooks returned None). Under the twin, which checks every hook's return, a
    backward with overlapping reduction gives the gradients of a backward without hooks."""
    from mindspore import ops

    from tests.finetune.contracts import twins

    red = GradReduction(_params(), Buckets(), overlap=True)
    g = ms.Tensor(np.ones(2, np.float32))
    assert red._hook(0)(g) is g  # unarmed, as in the earlier micro-batches' backward
    red.arm(None)
    assert red._hook(1)(g) is g

    calls = {}
    monkeypatch.setattr(ms.Parameter, "register_hook", twins.register_hook_twin(ms.Parameter.register_hook, calls))
    params = _params()
    x = ms.Tensor(np.arange(2, dtype=np.float32))

    def loss():
        return ops.sum(params[0] * x) + ops.sum(params[1] * params[2] * x)

    _, plain = ms.value_and_grad(loss, None, params)()
    opt = Buckets()
    red = GradReduction(params, opt, overlap=True)
    red.arm(None)
    _, hooked = ms.value_and_grad(loss, None, params)()
    out = red.finish(hooked)
    assert calls["register_hook"] == 3 and opt.launched == [2, 1, 0]
    for a, b in zip(hooked, plain):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    assert [[x.asnumpy().tolist() for x in b] for b in out] == \
        [[plain[0].asnumpy().tolist()], [plain[1].asnumpy().tolist(), plain[2].asnumpy().tolist()],
         [plain[2].asnumpy().tolist()]]


def test_the_reduce_scatter_input_stays_referenced_until_wait(monkeypatch):
    """Issue 18 section 1.4: the buffer handed to an asynchronous reduce_scatter_tensor is kept until its
    wait() (the old InFlight kept only the output: a bucket built for the call was freed at once).
    The twin holds only a weak reference and refuses a wait() after the input was freed."""
    import gc

    from mindspore import ops
    from mindspore.mint import distributed

    from finetune.collectives import reduce_scatter_sum_async
    from tests.finetune.contracts import twins

    class Done:
        def wait(self):
            pass

    calls = {}
    monkeypatch.setattr(distributed, "reduce_scatter_tensor", twins.reduce_scatter_tensor_twin(
        lambda t, op, group, async_op: Done(), lambda group: 2, lambda group: 1, calls))
    flight = reduce_scatter_sum_async(ops.arange(8).astype(ms.float32) * 2, 2, 1, "dp-0-1", native=True)
    gc.collect()
    assert flight.wait().asnumpy().tolist() == [8.0, 10.0, 12.0, 14.0] and calls["reduce_scatter_tensor"] == 1
