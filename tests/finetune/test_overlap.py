"""GradReduction in one process: bucket launch order and the error a broken hook contract gives."""
import mindspore as ms
import numpy as np
import pytest

from finetune.dist import Ready
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
