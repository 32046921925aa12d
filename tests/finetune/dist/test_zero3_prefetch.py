"""ZeRO-3's prefetch (issue 33 item 1) in one process: the recorded sequence of DP gathers and layer computes.

DP 1 over MindSpore's collectives (a ``TensorChannel``, whose gathers ``TensorChannel.start_gather`` starts
asynchronously): every start of a bucket's all-gather, every wait for one and every layer compute is recorded, on
a 3-layer model whose layers span several small buckets (some shared by two layers). The forward starts layer
n + 1's gathers before layer n computes and waits for them after it, the recomputed backward the same with n - 1,
at most two layers gathered at any compute, and the loss and gradients stay the plain model's. Without prefetch
(each gather started and waited right before its layer) the sequence differs, so the test fails.
Under msrun, the asynchronous gathers on CPU: LoRA ZeRO-3 at TP 2 x DP 2 over MindSpore's collectives
(``parallel.host_collectives=false``: each DP group is a sub-group, so a gather is the emulated AllReduce, started
with ``async_op``; the adapters and the frozen base prefetched) equals LoRA in one process, and says that nothing
overlaps on CPU. The full fine-tune's parity (DP 4 there gathers with ``mint.distributed.all_gather``) is
test_zero3_msrun.py's.
"""
import mindspore as ms
import numpy as np
import pytest
from mindspore import nn
from test_zero2_msrun import _run
from test_zero3_layers import assert_same_step
from test_zero3_lora_msrun import LORA, _adapters_close
from test_zero3_msrun import _same_run

from finetune.dist import RankInfo
from finetune.model.decoder import DecoderLM, ModelConfig
from finetune.optim import ShardedAdamW
from finetune import transport
from finetune.parallel.zero3 import ShardedWeights, Zero3Reduction, shard_layers
from jobspec.config import TrainConfig
from jobspec.recipe_load import load_recipe
from jobspec.tiny import tiny_config

LAYERS = 3
BUCKET_BYTES = 64 * 1024  # a layer of the tiny model is ~185 KB in fp32: 3-4 buckets each


def _model() -> DecoderLM:
    ms.set_seed(0)
    return DecoderLM(ModelConfig.from_dict(tiny_config({"vocab_size": 512, "num_hidden_layers": LAYERS})))


class Recorded(nn.Cell):
    """A decoder layer that records its compute and how many layers are gathered or being gathered then."""

    def __init__(self, layer: nn.Cell, n: int, events: list, weights: ShardedWeights):
        super().__init__(auto_prefix=False)
        self.layer, self.n, self._events, self._weights = layer, n, events, weights

    def construct(self, *args):
        w = self._weights
        self._events.append(("compute", self.n, len(w.held) + (getattr(w, "ahead", None) is not None)))
        return self.layer(*args)


class Wait:
    def __init__(self, k: int, value, events: list):
        self.k, self.value, self.events = k, value, events

    def wait(self):
        self.events.append(("wait", self.k))
        return self.value


def _recording(monkeypatch, model: DecoderLM, opt: ShardedAdamW, weights: ShardedWeights) -> list:
    """The event list every gather (asynchronous or not) and every layer compute appends to."""
    events: list = []

    def bucket(chunk) -> int:
        return next(k for k, c in weights.chunks.items() if c is chunk)

    def started(chunk, *args, **kwargs):
        events.append(("start", bucket(chunk)))
        return Wait(bucket(chunk), chunk, events)

    def gather(k, chunk):  # a synchronous gather: started and waited at once
        events.extend([("start", k), ("wait", k)])
        return chunk

    monkeypatch.setattr(transport, "all_gather_async", started)
    monkeypatch.setattr(opt.channel, "gather", gather)
    for n, gathered in enumerate(model.model.layers):
        gathered.layer = Recorded(gathered.layer, n, events, weights)
    return events


def _layer(spans: list, n: int, computes: int) -> list:
    """Layer ``n``'s expected events: its gathers waited, the next layer's (``computes``) started, then its
    compute with two layers gathered (one where nothing comes next)."""
    nxt = [("start", k) for k in spans[computes]] if computes is not None else []
    return [*(("wait", k) for k in spans[n]), *nxt, ("compute", n, 2 if nxt else 1)]


def test_next_layers_gathers_start_before_a_layer_computes_and_are_waited_after_it(ms_cpu, monkeypatch):
    plain, model = _model(), _model()
    for a, b in zip(plain.trainable_params(), model.trainable_params()):
        b.set_data(a.copy())
    params = model.trainable_params()
    opt = ShardedAdamW(params, TrainConfig(), RankInfo(), bucket_bytes=BUCKET_BYTES)
    weights = shard_layers(model, opt, RankInfo())
    reduction = Zero3Reduction(params, opt, weights)
    weights.release()
    spans = weights.spans
    assert all(len(s) >= 2 for s in spans) and set(spans[0]) & set(spans[1])  # several buckets, one shared
    events = _recording(monkeypatch, model, opt, weights)

    assert_same_step(model, params, reduction, opt, plain, plain.trainable_params())
    forward = [("start", k) for k in spans[0]]
    for n in range(LAYERS):
        forward += _layer(spans, n, n + 1 if n + 1 < LAYERS else None)
    backward = [("start", k) for k in spans[LAYERS - 1]]
    for n in reversed(range(LAYERS)):
        backward += _layer(spans, n, n - 1 if n > 0 else None)
    assert events == forward + backward
    assert weights.ahead is None and not weights.held  # nothing left gathered or in flight

    events.clear()
    with weights.use(0, ahead=1):  # a pass that stops after layer 0: layer 1's gathers are in flight
        pass
    assert_same_step(model, params, reduction, opt, plain, plain.trainable_params())
    stale = [("start", k) for k in spans[0]] + [("wait", k) for k in spans[0]] + [("start", k) for k in spans[1]]
    assert events[:len(stale) + len(spans[1])] == stale + [("wait", k) for k in spans[1]]  # waited and dropped
    assert events[len(stale) + len(spans[1]):] == forward + backward


class Synchronous:
    """A channel whose gather is done when called (as the shared-memory ``HostChannel``'s)."""

    def __init__(self):
        self.calls: list[int] = []

    def gather(self, k, chunk):
        self.calls.append(k)
        return chunk


def test_a_synchronous_channel_gathers_at_the_start_and_says_it_does_not_overlap():
    channel, chunk = Synchronous(), np.zeros(4, np.float32)
    flight = transport.HostChannel.start_gather(channel, 3, chunk)  # as the shared-memory channel does
    assert channel.calls == [3]  # the prefetch's gather is done in the same order, before the layer computes
    assert flight.wait() is chunk
    assert transport.HostChannel.describe_prefetch(channel).endswith(
        "not overlapped on this transport: its gathers are synchronous copies through shared memory")


@pytest.mark.parametrize("target, overlapped", [("Ascend", True), ("CPU", False)])
def test_mindspores_collectives_overlap_only_on_ascend(target, overlapped):
    channel = RankInfo(device_target=target, dp=2, dp_group="dp").dp_comm.channel([8])
    assert ("not overlapped" not in channel.describe_prefetch()) == overlapped


@pytest.mark.slow
def test_lora_zero3_over_mindspores_async_collectives_equals_lora_in_one_process(module_tmp):
    from jobspec.tiny import ensure_tiny_model

    ensure_tiny_model(module_tmp / "base-model", load_recipe("tiny-cpu").model.init, 0)
    ref = _run(module_tmp, "lora-one", 1, **LORA)
    out = _run(module_tmp, "lora-tp2dp2-zero3-async", 2, 2,
               **{"parallel.zero": "3", "parallel.host_collectives": "false", **LORA})
    log = (out / "msrun-logs-0" / "worker_0.log").read_text(errors="replace")
    assert "reduce-scatter via AllReduce, all-gather via AllReduce" in log  # MindSpore's collectives, emulated
    assert ("the next layer's gathers (forward: n + 1, backward: n - 1) started in the same order, but prefetch is "
            "not overlapped on this transport: MindSpore's CPU backend runs a collective before the kernels") in log
    _same_run(out, ref, "LoRA tp 2 dp 2 ZeRO-3, asynchronous gathers")
    _adapters_close(out, ref, "LoRA tp 2 dp 2 ZeRO-3, asynchronous gathers")
