"""Gradient reduction across data-parallel ranks and the global gradient norm.

The trainer scales each micro-batch's summed token loss by ``1 / global_label_tokens`` (the label
tokens of the whole global batch, equal on every rank). The one-process gradient is then the SUM of
every DP rank's gradient, so the DP reduction here is a sum, not an average.

A parameter is *TP-partitioned* when its ``tp_axis`` attribute is an int (set by the model from its
TP layout): each TP rank holds a different slice and its squared gradient counts once per rank,
except copies with ``tp_owner = False`` (a KV head replicated on several TP ranks when
tp > num_key_value_heads), which are counted on their owner rank only. Parameters without
``tp_axis`` are replicated over TP with identical gradients on every TP rank (counted once).
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import ops

from finetune.collectives import Ready, all_reduce_sum
from finetune.dist import RankInfo
from finetune.hostmem import in_blocks
from finetune.transport import Channel
from jobspec.memory import BUCKET_BYTES


def buckets_by_bytes(sizes: list[int], itemsize: int, limit: int = BUCKET_BYTES) -> list[list[int]]:
    """Consecutive index groups whose byte size stays under ``limit`` (a larger tensor is alone)."""
    out: list[list[int]] = []
    cur: list[int] = []
    nbytes = 0
    for i, n in enumerate(sizes):
        if cur and nbytes + n * itemsize > limit:
            out.append(cur)
            cur, nbytes = [], 0
        cur.append(i)
        nbytes += n * itemsize
    if cur:
        out.append(cur)
    return out


class BucketSum:
    """The DP sum of one bucket of fp32 gradients (bucket ``k`` of ``channel``), in flight; ``wait()`` gives one
    tensor per gradient."""

    def __init__(self, grads: list, channel: Channel, k: int = 0):
        self.shapes = [g.shape for g in grads]
        self.flight = channel.sum(k, [(g, 0, int(np.prod(g.shape))) for g in grads])

    def wait(self) -> list:
        total = self.flight.wait()
        out, offset = [], 0
        for shape in self.shapes:
            n = int(np.prod(shape))
            out.append(total[offset:offset + n].reshape(shape))
            offset += n
        return out


def sum_bucket_over_dp(grads: list, rank: RankInfo, channel: Channel | None = None, k: int = 0) -> BucketSum | Ready:
    """Start the SUM of one bucket of gradients over the DP group in fp32, whatever their dtype (bucket ``k`` of
    ``channel``, by default a channel of this one bucket); in one DP rank only the fp32 cast. A gradient that is
    fp32 already may be overwritten with the sum."""
    grads = [g if g.dtype == ms.float32 else g.astype(ms.float32) for g in grads]
    if rank.dp == 1:
        return Ready(grads)
    return BucketSum(grads, channel or rank.dp_comm.channel([sum(int(np.prod(g.shape)) for g in grads)]), k)


def is_tp_partitioned(param) -> bool:
    """True when ``param`` holds this TP rank's slice (the model sets ``param.tp_axis``)."""
    return isinstance(getattr(param, "tp_axis", None), int)


def norm_weights(param) -> tuple[float, float]:
    """(split, replicated) weights of ``param``'s squared gradient in the whole-model norm."""
    if not is_tp_partitioned(param):
        return 0.0, 1.0
    return (1.0 if getattr(param, "tp_owner", True) else 0.0), 0.0


PARTIALS = 64  # squared sums are kept as this many row partials (see square_partials)


def square_partials(x: ms.Tensor) -> ms.Tensor:
    """The squares of ``x`` (fp32) summed into ``PARTIALS`` row partials, in a fixed order.

    MindSpore's CPU full reduction (``ops.sum`` over all axes) is not deterministic: the same tensor
    can sum to a different last bit depending on earlier calls, which broke exact resume. A
    reduction along rows is: each partial is one row's sum. The partials are added in a fixed
    order (``tree_sum``).
    """
    x = x.reshape(-1).astype(ms.float32)
    n = x.shape[0]
    body = n - n % PARTIALS
    tail = ops.square(x[body:]) if body < n else None
    if tail is not None:
        tail = ops.cat([tail, ops.zeros((PARTIALS - (n - body),), dtype=ms.float32)])
    if body == 0:
        return tail
    rows = ops.square(x[:body].reshape(PARTIALS, -1)).sum(axis=1)
    return rows if tail is None else rows + tail


def tree_sum(x: ms.Tensor) -> ms.Tensor:
    """The sum of a 1-D tensor of power-of-two length by halving: elementwise adds in a fixed order."""
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        x = x[:half] + x[half:]
    return x.reshape(())


def finish_norm(split: ms.Tensor, replicated: ms.Tensor, rank: RankInfo) -> ms.Tensor:
    """Whole-model L2 norm (a device scalar) from this rank's partials over DP-reduced gradients.

    ``split``: partials of TP-partitioned grads (summed over the TP group here); ``replicated``:
    partials of TP-replicated grads (already whole, counted once).
    """
    return ops.sqrt(tree_sum(all_reduce_sum(split, rank.tp_group) + replicated))


NormPiece = tuple[int, "slice | None", float, float]  # (tensor index, flat slice or whole, split weight, replicated)


def norm_partials(tensors: list, pieces: list[NormPiece], on_host: bool = False) -> tuple[ms.Tensor, ms.Tensor]:
    """(split, replicated) square partials of ``pieces`` of ``tensors``, summed in order: the one accumulation
    of the whole-model norm. Weights from ``norm_weights``. ``on_host`` (CPU, ``StepGate.on_host``): in numpy,
    one pass over each fp32 tensor's memory (``asnumpy``: its own, or a copy of a view, one at a time) instead
    of MindSpore's square, sum and adds, whose temporaries were 3x the largest gradient (docs/memory.md)."""
    host = on_host and all(t.dtype == ms.float32 for t in tensors)
    square = host_square_partials if host else square_partials
    split, rep = ((np.zeros(PARTIALS, np.float32), np.zeros(PARTIALS, np.float32)) if host
                  else (ops.zeros((PARTIALS,), dtype=ms.float32), ops.zeros((PARTIALS,), dtype=ms.float32)))
    for i, part, ws, wr in pieces:
        x = tensors[i].asnumpy().reshape(-1) if host else tensors[i]
        sq = square(x if part is None else x[part])
        if ws:
            split = split + sq * ws
        if wr:
            rep = rep + sq * wr
    return (ms.Tensor(split), ms.Tensor(rep)) if host else (split, rep)


def host_square_partials(x: np.ndarray) -> np.ndarray:
    """``square_partials`` of a flat fp32 ndarray in numpy: the same 64 row partials (each row summed
    by numpy alone, so the bits do not depend on how many cores share the rows)."""
    n = x.size
    body = n - n % PARTIALS
    out = np.zeros(PARTIALS, np.float32)
    if body:
        rows = x[:body].reshape(PARTIALS, -1)

        def part(lo: int, hi: int) -> None:
            np.einsum("ij,ij->i", rows[lo:hi], rows[lo:hi], out=out[lo:hi])
        in_blocks(PARTIALS, 8, part)
    out[:n - body] += np.square(x[body:])
    return out


def global_grad_norm(grads: tuple | list, params: list, rank: RankInfo, on_host: bool = False) -> ms.Tensor:
    """L2 norm of the whole model's (DP-reduced) gradient, a device scalar; each TP slice counted
    once; deterministic. ``on_host`` (CPU, ``StepGate.on_host``): in numpy when every gradient owns its memory."""
    pieces: list[NormPiece] = [(i, None, *norm_weights(p)) for i, p in enumerate(params)]
    return finish_norm(*norm_partials(list(grads), pieces, on_host), rank)
