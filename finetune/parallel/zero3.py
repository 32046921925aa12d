"""ZeRO-3 (``layout.shard_weights``): each DP rank keeps only its chunks of the compute-dtype decoder-layer weights.

The chunks are the sharded optimizer's (``jobspec/shard_layout.py``: rank ``r`` owns chunk ``r`` of every bucket), so
the optimizer updates its chunk and keeps it (``ShardedWeights.write``) instead of all-gathering the bucket into the
parameters; the embedding, final norm and LM head stay whole on every rank (gathered after each step as in ZeRO-1/2).

A decoder layer runs inside :class:`GatheredLayer`, a custom-bprop Cell: its forward all-gathers the buckets holding
the layer (``Channel.gather``), writes the layer's Parameters whole, runs the layer without recording the autodiff
tape and puts one-element placeholders back, so nothing keeps the whole weights. Its backward gathers them again,
recomputes the layer with the gradient (as ``train.recompute`` does), hands the weight gradients to the step's
reduction (``Zero3Reduction``: reduce-scattered into this rank's fp32 chunks as in ZeRO-2) and releases the weights.
So ZeRO-3 recomputes every layer whatever ``train.recompute`` says. A bucket straddling two layers is gathered for
each. Saving, export and evaluation hold the whole model for their duration (``ShardedWeights.whole``).
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
from finetune.transport import Target


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
        self.chunks: list = []
        self.held = set(range(len(layers)))  # the layers whose weights are whole now
        self.sink: Callable[[int, ms.Tensor], None] | None = None  # where a layer's weight gradients go

    def release(self) -> None:
        """Take this rank's chunks from the (whole) weights and drop every layer's whole weights; from now on the
        optimizer reads and writes the chunks (``ShardedAdamW.weights``)."""
        self.chunks = [self.opt.own_chunk(k).astype(self.dtypes[k]) for k in range(len(self.opt.buckets))]
        self.opt.weights = self
        for n in sorted(self.held):
            self._drop(n)

    def _drop(self, n: int) -> None:
        for i in self.layers[n]:
            p = self.opt.params[i]
            p.set_data(ops.zeros((1,) * len(self.shapes[i]), dtype=p.dtype))
        self.held.discard(n)

    def _gather(self, n: int) -> None:
        full = {k: self.opt.channel.gather(k, self.chunks[k]) for k in self.spans[n]}
        for i in self.layers[n]:
            p = self.opt.params[i]
            parts = [full[k][a:b] for k, a, b in self.pieces[i]]
            flat = ops.cat(parts) if len(parts) > 1 else parts[0]
            p.set_data(flat.reshape(self.shapes[i]).astype(p.dtype))
        self.held.add(n)

    @contextlib.contextmanager
    def use(self, n: int) -> Iterator[None]:
        """Layer ``n``'s weights whole inside (gathered and released unless already held: collective)."""
        if n in self.held:
            yield
            return
        with ms._no_grad():
            self._gather(n)
        try:
            yield
        finally:
            self._drop(n)

    @contextlib.contextmanager
    def whole(self) -> Iterator[None]:
        """Every layer's weights whole inside (checkpoint, export, evaluation; collective)."""
        gathered = [n for n in range(len(self.layers)) if n not in self.held]
        with ms._no_grad():
            for n in gathered:
                self._gather(n)
        try:
            yield
        finally:
            for n in gathered:
                self._drop(n)

    def write(self, k: int, chunk: ms.Tensor) -> None:
        """The optimizer's updated chunk of bucket ``k``: kept; the whole weights in the bucket all-gathered."""
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
        with self._weights.use(self.n), ms._no_grad():
            return self.layer(*args)

    def bprop(self, *args):
        inputs, dout = list(args[:-2]), args[-1]
        detached = [ops.stop_gradient(a) if isinstance(a, ms.Tensor) else a for a in inputs]
        w = self._weights
        with w.use(self.n):
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
             "whole")
    return weights


class Zero3Reduction(ShardedAccumulation):
    """ZeRO-2's reduction where the decoder layers' gradients come from their backward (``ShardedWeights.arrived``),
    not from the autodiff's results: the backward differentiates only the whole weights (``taped``)."""

    def __init__(self, params: list, opt: Any, weights: ShardedWeights):
        self.tape = [i for i in range(len(params)) if i not in weights.sharded]
        super().__init__(params, opt, overlap=True)  # the layers' gradients reduce as they come, so the others must
        weights.sink = self._arrive

    def hooked(self, params: list) -> list[int]:
        return self.tape

    def taped(self, params: list) -> list:
        return [params[i] for i in self.tape]

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
