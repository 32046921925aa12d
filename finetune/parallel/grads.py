"""Gradient reduction across data-parallel ranks and the global gradient norm.

Single-process versions; the distributed-training work fills in DP (bucketed all-reduce) and TP.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import ops

from finetune.dist import RankInfo


def reduce_grads(grads: tuple, rank: RankInfo) -> tuple:
    """Average gradients over the DP group (identity when dp == 1)."""
    if rank.dp == 1:
        return grads
    raise NotImplementedError("DP gradient reduction is built by the distributed-training work")


def global_grad_norm(grads: tuple, params: list, rank: RankInfo) -> ms.Tensor:
    """L2 norm over all gradients of the whole model (each TP-split parameter's shards counted once)."""
    total = ops.zeros((), ms.float32)
    for g in grads:
        total = total + ops.sum(ops.square(g.astype(ms.float32)))
    if rank.tp == 1:
        return ops.sqrt(total)
    raise NotImplementedError("TP-aware grad norm is built by the distributed-training work")
