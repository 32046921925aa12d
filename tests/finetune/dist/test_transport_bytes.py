"""The DP channel's byte counter (``Channel.sent``, metrics.jsonl ``dp_sent_bytes``): what each collective sends as
a native ring would, from the calls actually made (sizes, padding, dtypes), against the per-step formula of
``jobspec.layout_choice.step_traffic``. One process: a channel of a two-member group with no group to talk to
(every collective is then the identity), so only the counting runs."""
import mindspore as ms
import numpy as np

from finetune.transport import Collectives, ring_bytes
from jobspec.layout_choice import step_traffic


def test_each_collective_counts_what_a_ring_member_sends():
    channel = Collectives(2, 0, None).channel([8, 6])
    flat = ms.Tensor(np.ones(6, np.float32))
    channel.sum(0, [(flat, 0, 6)])  # an all-reduce of the 8-element bucket (padded): 2 x 32 x 1/2
    assert channel.sent == 32
    channel.reduce_scatter(1, [(flat, 0, 6)])  # fp32, 6 elements: 24 x 1/2
    assert channel.sent == 32 + 12
    channel.gather(1, ms.Tensor(np.ones(3, np.float16)))  # each member's 6-byte chunk: 12 x 1/2
    assert channel.sent == 32 + 12 + 6
    assert ring_bytes(100, 4) == 75 and ring_bytes(100, 4, 2) == 150 and ring_bytes(100, 1) == 0


def test_the_formula_is_the_counted_calls_of_each_stage():
    """n elements in one bucket, d members, A micro-batches, fp32 weights: the calls each stage makes per step
    (ZeRO-1: one reduce-scatter and one all-gather; ZeRO-2: A reduce-scatters; ZeRO-3: A reduce-scatters and two
    gathers of the weights per micro-batch, none after the step), counted, equal ``step_traffic``."""
    n, d, a = 12, 2, 3
    parts = [(ms.Tensor(np.ones(n, np.float32)), 0, n)]
    chunk = ms.Tensor(np.ones(n // d, np.float32))
    calls = {0: lambda c: c.sum(0, parts),
             1: lambda c: (c.reduce_scatter(0, parts), c.gather(0, chunk)),
             2: lambda c: ([c.reduce_scatter(0, parts) for _ in range(a)], c.gather(0, chunk)),
             3: lambda c: [(c.gather(0, chunk), c.gather(0, chunk), c.reduce_scatter(0, parts)) for _ in range(a)]}
    for stage, call in calls.items():
        channel = Collectives(d, 0, None).channel([n])
        call(channel)
        assert channel.sent == step_traffic(stage, weights=n, trained=n, dp=d, grad_accum=a, nbytes=4), stage
