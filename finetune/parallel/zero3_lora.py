"""ZeRO-3 with LoRA (``train.method: lora``, ``parallel.zero: 3``): the frozen base's decoder layers sharded too.

The adapters are the optimizer's parameters, so ``zero3.ShardedWeights`` shards and gathers them as it does a full
fine-tune's weights. The frozen base weights belong to no optimizer: :class:`FrozenShards` lays each decoder
layer's frozen weights end to end (compute dtype) and cuts them into ``dp`` equal chunks, the last zero-padded;
DP rank ``r`` keeps chunk ``r`` of every layer. ``ShardedWeights`` gathers (and prefetches) and drops them with the
layer's adapters (its ``frozen``), so the base is whole exactly when the adapters are: the layer's forward, its
recomputed backward, saving, export and evaluation. One gather-only channel bucket per layer (no fp32 sum
buffers: nothing is summed).

Every trained weight is then a layer's, whose gradient the layer's own backward hands over, so the step's tape
would differentiate nothing and MindSpore would skip the backward. :class:`Anchored` adds a trainable zero to
layer 0's input (exact: ``x + 0 = x``); the step differentiates it (``zero3.Zero3Reduction.taped``) and drops its
gradient, so the backward runs through every layer.
"""
from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import Parameter, nn, ops

from finetune.dist import RankInfo
from finetune.transport import Flight


class FrozenShards:
    """This DP rank's chunk of each decoder layer's frozen weights; built while they are whole."""

    def __init__(self, layers: list, rank: RankInfo):
        self.params = [[p for p in layer.get_parameters() if not p.requires_grad] for layer in layers]
        self.shapes = [[tuple(p.shape) for p in ps] for ps in self.params]
        self.sizes = [[int(np.prod(s)) for s in shapes] for shapes in self.shapes]
        self.dp, self.index = rank.dp, rank.dp_rank
        self.lengths = [math.ceil(sum(sizes) / self.dp) * self.dp for sizes in self.sizes]
        frozen = [p for ps in self.params for p in ps]
        self.channel = rank.dp_comm.channel(self.lengths, frozen, sums=False)  # collective: every rank, same order
        self.chunks: list = []
        whole = sum(int(np.prod(p.shape)) for p in frozen)
        rank.log(f"[train] ZeRO-3 with LoRA: the frozen base's decoder layers ({whole / 1e6:.2f} M elements on this "
                 f"rank before sharding) sharded too: each rank keeps 1/{self.dp} of every layer's frozen weights, "
                 "gathered with its adapters")

    def release(self) -> None:
        """Keep this rank's chunk of every layer (the caller drops the whole weights)."""
        for n, ps in enumerate(self.params):
            c = self.lengths[n] // self.dp
            flat = ops.cat([p.reshape(-1) for p in ps]) if len(ps) > 1 else ps[0].reshape(-1)
            mine = flat[min(self.index * c, flat.shape[0]):(self.index + 1) * c]
            if mine.shape[0] < c:
                mine = ops.cat([mine, ops.zeros((c - mine.shape[0],), dtype=flat.dtype)])
            self.chunks.append(mine.copy())

    def start(self, n: int) -> Flight:
        """Layer ``n``'s gather started (a collective; the channel's ``start_gather``)."""
        return self.channel.start_gather(n, self.chunks[n])

    def put(self, n: int, full: ms.Tensor) -> None:
        """Layer ``n``'s frozen weights whole from its gather's result ``full``."""
        at = 0
        for p, shape, size in zip(self.params[n], self.shapes[n], self.sizes[n]):
            p.set_data(full[at:at + size].copy().reshape(shape).astype(p.dtype))  # not a view: as zero3's _put
            at += size

    def drop(self, n: int) -> None:
        """Layer ``n``'s frozen weights back to one-element placeholders."""
        for p, shape in zip(self.params[n], self.shapes[n]):
            p.set_data(ops.zeros((1,) * len(shape), dtype=p.dtype))


class Anchored(nn.Cell):
    """Layer 0 with ``anchor`` (a trainable fp32 zero, not registered in the Cell tree: no checkpoint or export sees
    it) added to its input."""

    def __init__(self, layer: nn.Cell, anchor: Parameter):
        super().__init__(auto_prefix=False)
        self.layer, self._anchor = layer, [anchor]

    def construct(self, x, *rest):
        return self.layer(x + self._anchor[0].astype(x.dtype), *rest)


def shard_frozen_base(model, weights, rank: RankInfo) -> None:
    """Shard ``model``'s frozen decoder-layer weights beside ``weights`` (``zero3.ShardedWeights`` of the adapters;
    its ``frozen``, ``anchor``) and anchor the backward at layer 0's input; call before ``weights.release``."""
    layers = model.model.layers
    weights.frozen = FrozenShards(list(layers), rank)
    weights.anchor = Parameter(ms.Tensor(np.zeros((1,), np.float32)), name="zero3_lora.anchor", requires_grad=True)
    names = {id(p): p.name for p in model.get_parameters()}
    layers[0] = Anchored(layers[0], weights.anchor)
    for p in model.get_parameters():  # the CellList prefixed them again
        p.name = names[id(p)]
