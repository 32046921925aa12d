"""ZeRO-3 (``layout.shard_weights``): each DP rank keeps only its chunks of the compute-dtype decoder-layer weights.

The chunks are the sharded optimizer's (``jobspec/shard_layout.py``: rank ``r`` owns chunk ``r`` of every bucket),
kept for the buckets holding a piece of a layer, so the optimizer updates its chunk and keeps it
(``ShardedWeights.write``) instead of all-gathering the bucket into the parameters; the embedding, final norm and LM
head stay whole on every rank (gathered after each step as in ZeRO-1/2).

A decoder layer runs inside :class:`GatheredLayer`, a custom-bprop Cell: its forward all-gathers the buckets holding
the layer (``Channel.gather``), writes the layer's Parameters whole, runs the layer without recording the autodiff
tape and puts one-element placeholders back, so nothing keeps the whole weights. Its backward gathers them again,
recomputes the layer with the gradient (as ``train.recompute`` does), hands the weight gradients to the step's
reduction (``Zero3Reduction``: reduce-scattered into this rank's fp32 chunks as in ZeRO-2) and releases the weights.
So ZeRO-3 recomputes every layer whatever ``train.recompute`` says. A bucket straddling two layers is gathered for
each. Prefetch: once a layer's weights are written, the gathers of the layer used next (n + 1 in the forward, n - 1
in the backward) are started (the channel's ``start_gather``: asynchronous over MindSpore's collectives, done at
once on the shared-memory channel) and waited for only when that layer runs, so a rank holds one layer's weights and
at most one more layer's gather buckets. Evaluation and the sample check run the same forwards (every DP rank in
step); checkpoint and export stream the layers to the host of the rank that writes them (``ShardedWeights.on_host``,
no prefetch), so no rank's device ever holds more than one gathered layer. With LoRA the sharded weights are the
adapters, and the frozen base's layer weights are sharded beside them (``ShardedWeights.frozen``:
``zero3_lora.FrozenShards``, gathered, prefetched and dropped with each layer).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import mindspore as ms
from mindspore import nn, ops
from mindspore.common.recompute import _padding_input_grads
from mindspore.ops import GradOperation

from finetune.dist import RankInfo
from finetune.optim.update import write_param
from finetune.parallel.overlap import ShardedAccumulation
from finetune.parallel.zero3_lora import FrozenShards
from finetune.transport import Flight, Target

Started = tuple[dict[int, Flight], Flight | None]  # a layer's gathers in flight: per bucket, and LoRA's frozen base


class ShardedWeights:
    """This rank's weight chunks of ``opt``'s buckets (compute dtype; fp32 where a bucket holds an fp32 weight) and
    which decoder layers they hold. Built while every weight is whole; :meth:`release` shards them."""

    def __init__(self, opt: Any, layers: list):
        self.opt = opt
        index = {id(p): i for i, p in enumerate(opt.params)}
        self.layers = [[index[id(p)] for p in layer.trainable_params()] for layer in layers]
        self.sharded = {i for idx in self.layers for i in idx}
        self.shapes = {i: tuple(opt.params[i].shape) for i in self.sharded}
        self.pieces: dict[int, list[tuple[int, int, int]]] = {i: [] for i in self.sharded}  # (bucket, start, end)
        self.whole_targets: list[list[Target]] = []  # per bucket: the ranges of whole weights its gather writes
        for k, targets in enumerate(opt.targets):
            for p, a, b, at in targets:
                if index[id(p)] in self.sharded:
                    self.pieces[index[id(p)]].append((k, at, at + b - a))
            self.whole_targets.append([t for t in targets if index[id(t[0])] not in self.sharded])
        self.spans = [sorted({k for i in idx for k, _, _ in self.pieces[i]}) for idx in self.layers]
        self.dtypes = [ms.float32 if any(t[0].dtype == ms.float32 for t in targets) else targets[0][0].dtype
                       for targets in opt.targets]
        self.chunks: dict[int, ms.Tensor] = {}  # per bucket holding a layer's weight: this rank's chunk
        self.held = set(range(len(layers)))  # the layers whose weights are whole now
        self.sink: Callable[[int, ms.Tensor], None] | None = None  # where a layer's weight gradients go
        self.frozen: FrozenShards | None = None  # LoRA: the frozen base's shards, gathered and dropped with the layer
        self.anchor: ms.Parameter | None = None  # LoRA: what the step differentiates (zero3_lora.Anchored)
        self.ahead: tuple[int, Started] | None = None  # the layer whose gathers were started early, and them

    def release(self) -> None:
        """Take this rank's chunks from the (whole) weights and drop every layer's whole weights; from now on the
        optimizer reads and writes the chunks (``ShardedAdamW.weights``)."""
        kept = sorted({k for span in self.spans for k in span})
        self.chunks = {k: self.opt.own_chunk(k).astype(self.dtypes[k]) for k in kept}
        self.opt.weights = self
        if self.frozen is not None:
            self.frozen.release()
        for n in sorted(self.held):
            self._drop(n)

    def _drop(self, n: int) -> None:
        for i in self.layers[n]:
            p = self.opt.params[i]
            p.set_data(ops.zeros((1,) * len(self.shapes[i]), dtype=p.dtype))
        if self.frozen is not None:
            self.frozen.drop(n)
        self.held.discard(n)

    def _start(self, n: int) -> Started:
        """Layer ``n``'s gathers started (collective: every DP rank, same order)."""
        flights = {k: self.opt.channel.start_gather(k, self.chunks[k]) for k in self.spans[n]}
        return flights, None if self.frozen is None else self.frozen.start(n)

    def _put(self, n: int, started: Started) -> None:
        """Wait for layer ``n``'s gathers and write its weights whole: copies, never views of the gathered buckets
        (a MindSpore slice or reshape may share the bucket's memory), so the buckets are freed before the next
        layer's gathers start."""
        flights, frozen = started
        full = {k: f.wait() for k, f in flights.items()}
        for i in self.layers[n]:
            p = self.opt.params[i]
            parts = [full[k][a:b] for k, a, b in self.pieces[i]]
            flat = ops.cat(parts) if len(parts) > 1 else parts[0].copy()
            p.set_data(flat.reshape(self.shapes[i]).astype(p.dtype))
        if self.frozen is not None and frozen is not None:  # LoRA: the frozen base's layer
            self.frozen.put(n, frozen.wait())
        self.held.add(n)

    def _gather(self, n: int) -> None:
        self._put(n, self._start(n))

    def _take(self, n: int) -> Started:
        """Layer ``n``'s gathers: the ones started early, else started now. Ones started for another layer (a pass
        that stopped before using them) are waited for and dropped, so no collective is left in flight."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[0] == n:
            return ahead[1]
        if ahead is not None:
            flights, frozen = ahead[1]
            for f in [*flights.values(), *([] if frozen is None else [frozen])]:
                f.wait()
        return self._start(n)

    @contextlib.contextmanager
    def use(self, n: int, ahead: int | None = None) -> Iterator[None]:
        """Layer ``n``'s weights whole inside (gathered and released unless already held: collective); ``ahead``:
        the layer used next (n + 1 in the forward, n - 1 in the backward), whose gathers start once layer ``n``'s
        weights are written, before it computes (at most two layers gathered: ``n`` and ``ahead``)."""
        if n in self.held:
            yield
            return
        with ms._no_grad():
            self._put(n, self._take(n))
            if ahead is not None and 0 <= ahead < len(self.layers) and ahead not in self.held:
                self.ahead = ahead, self._start(ahead)
        try:
            yield
        finally:
            self._drop(n)

    @contextlib.contextmanager
    def on_host(self, keep: bool) -> Iterator[None]:
        """Every layer's weights whole inside on the host of the rank that keeps them (``keep``: the one writing the
        checkpoint or export), streamed layer by layer: each layer gathered (collective: every DP rank), kept as a
        host copy (a Tensor made from numpy, which MindSpore leaves on the host until an op uses it) or not, and
        its device copy released before the next; so the device holds at most one gathered layer and its gather
        buffers. The other ranks' layers stay placeholders. Not for a forward: that gathers itself (:meth:`use`)."""
        streamed = [n for n in range(len(self.layers)) if n not in self.held]
        try:
            with ms._no_grad():
                for n in streamed:
                    self._gather(n)
                    if keep:  # LoRA: the frozen base's layer too
                        frozen = self.frozen.params[n] if self.frozen is not None else []
                        for p in [*(self.opt.params[i] for i in self.layers[n]), *frozen]:
                            p.set_data(ms.Tensor(p.asnumpy()))  # a host copy; the gathered one is freed
                    else:
                        self._drop(n)
            yield
        finally:
            for n in streamed:
                if n in self.held:
                    self._drop(n)

    def nonfinite(self) -> list[str]:
        """The weights of the buckets whose chunk on this rank holds a non-finite value (no gather)."""
        bad = [k for k, chunk in self.chunks.items() if not bool(ops.isfinite(chunk).all())]
        return [t[0].name for k in bad for t in self.opt.targets[k]]

    def write(self, k: int, chunk: ms.Tensor) -> None:
        """The optimizer's updated chunk of bucket ``k``: kept where the bucket holds a layer's weight; the whole
        weights in the bucket all-gathered."""
        if k in self.chunks:
            self.chunks[k] = chunk.astype(self.dtypes[k])
        whole = self.whole_targets[k]
        if whole:
            self.opt.channel.gather_into(k, chunk.astype(whole[0][0].dtype), whole, write_param)

    def arrived(self, n: int, grads: tuple) -> None:
        """Layer ``n``'s weight gradients, from its backward."""
        if self.sink is None:
            raise RuntimeError("ZeRO-3: a layer's backward ran without the step's gradient reduction")
        for i, g in zip(self.layers[n], grads):
            self.sink(i, g)


class GatheredLayer(nn.Cell):
    """Decoder layer ``n`` with ZeRO-3's weights: gathered for its forward and again for its recomputed backward."""

    def __init__(self, layer: nn.Cell, n: int, weights: ShardedWeights):
        super().__init__(auto_prefix=False)
        self.layer, self.n = layer, n
        self._weights = weights
        self.grad = GradOperation(get_all=True, get_by_list=True, sens_param=True)

    def construct(self, *args):
        with self._weights.use(self.n, ahead=self.n + 1), ms._no_grad():
            return self.layer(*args)

    def bprop(self, *args):
        inputs, dout = list(args[:-2]), args[-1]
        detached = [ops.stop_gradient(a) if isinstance(a, ms.Tensor) else a for a in inputs]
        w = self._weights
        with w.use(self.n, ahead=self.n - 1):
            params = [w.opt.params[i] for i in w.layers[self.n]]
            dx, dw = self.grad(self.layer, params)(*detached, dout)
            w.arrived(self.n, dw)
        grads = list(dx)
        _padding_input_grads(inputs, grads)
        return tuple(grads)


def shard_layers(model: Any, opt: Any, rank: RankInfo) -> ShardedWeights:
    """Wrap ``model``'s decoder layers in :class:`GatheredLayer` over ``opt``'s chunks (the weights stay whole
    until :meth:`ShardedWeights.release`)."""
    layers = model.model.layers
    weights = ShardedWeights(opt, list(layers))
    names = {id(p): p.name for p in model.get_parameters()}
    for n in range(len(layers)):
        layers[n] = GatheredLayer(layers[n], n, weights)
    for p in model.get_parameters():  # the CellList prefixed them with the wrapper's attribute
        p.name = names[id(p)]
    rank.log(f"[train] ZeRO-3: each rank keeps 1/{rank.dp} of the {len(weights.layers)} decoder layers' weights, each "
             "layer gathered for its forward and again for its recomputed backward; embedding, final norm and LM head "
             "whole; the next layer's gathers (forward: n + 1, backward: n - 1) "
             f"{opt.channel.describe_prefetch()}")
    return weights


class Zero3Reduction(ShardedAccumulation):
    """ZeRO-2's reduction where the decoder layers' gradients come from their backward (``ShardedWeights.arrived``),
    not from the autodiff's results: the backward differentiates only the whole weights (``taped``)."""

    def __init__(self, params: list, opt: Any, weights: ShardedWeights):
        self.tape = [i for i in range(len(params)) if i not in weights.sharded]
        super().__init__(params, opt, overlap=True)  # the layers' gradients reduce as they come, so the others must
        weights.sink, self.weights = self._arrive, weights

    def hooked(self, params: list) -> list[int]:
        return self.tape

    def taped(self, params: list) -> list:
        """The whole weights, and LoRA's anchor (its gradient dropped by ``_expand``)."""
        return [params[i] for i in self.tape] + ([] if self.weights.anchor is None else [self.weights.anchor])

    def _expand(self, grads: list) -> list:
        full: list = [None] * len(self.users)
        for j, i in enumerate(self.tape):
            full[i] = grads[j]
        grads.clear()
        return full

    def add(self, acc: list | None, grads: list) -> list:
        return super().add(acc, self._expand(grads))

    def finish(self, grads: tuple | list) -> list:
        return super().finish(self._expand(list(grads)))
