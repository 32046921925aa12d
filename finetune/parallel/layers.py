"""Megatron-style tensor-parallel linear layers and their communication Cells.

With ``rank.tp == 1`` the linears are plain matmuls and no collective is created.
Weights follow Hugging Face's ``[out, in]`` layout (split axes: ``jobspec.model_layout``).
"""
from __future__ import annotations

import mindspore as ms
from mindspore import Parameter, nn, ops
from mindspore.common.initializer import Normal, initializer

from finetune.dist import RankInfo


class CopyToTP(nn.Cell):
    """Identity forward, all-reduce (sum) of the gradient over the TP group backward."""

    def __init__(self, rank: RankInfo):
        super().__init__()
        self.all_reduce = ops.AllReduce(ops.ReduceOp.SUM, rank.tp_group) if rank.tp > 1 else None

    def construct(self, x):
        return x

    def bprop(self, x, out, dout):
        return (self.all_reduce(dout) if self.all_reduce is not None else dout,)


class ReduceFromTP(nn.Cell):
    """All-reduce (sum) over the TP group forward, identity backward."""

    def __init__(self, rank: RankInfo):
        super().__init__()
        self.all_reduce = ops.AllReduce(ops.ReduceOp.SUM, rank.tp_group) if rank.tp > 1 else None

    def construct(self, x):
        return self.all_reduce(x) if self.all_reduce is not None else x

    def bprop(self, x, out, dout):
        return (dout,)


def _divide(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(f"{what}={n} is not divisible by parallel.tp={tp}; choose a parallel.tp that divides it")
    return n // tp


def linear(x, weight, bias, dtype):
    """``x @ weight.T + bias`` computed in ``dtype`` (weights are fp32 masters)."""
    if x.dtype != dtype:
        x = x.astype(dtype)
    if weight.dtype != dtype:
        weight = weight.astype(dtype)
        bias = bias.astype(dtype) if bias is not None else None
    return ops.dense(x, weight, bias)


class SumOverReplicas(nn.Cell):
    """Identity forward; backward sums the gradient over the TP ranks holding the same replica.

    For KV heads replicated when tp > num_key_value_heads: rank ``r`` of the TP group holds replica
    ``r // copies``, and each copy only sees the gradient of its own query heads. The gradient is
    placed in its replica's slot of a zero buffer and all-reduced over the TP group (no extra
    process group needed); every copy then holds the full, identical gradient.
    """

    def __init__(self, rank: RankInfo, replicas: int):
        super().__init__()
        self.replicas, self.slot = replicas, rank.tp_rank // (rank.tp // replicas)
        self.all_reduce = ops.AllReduce(ops.ReduceOp.SUM, rank.tp_group)

    def construct(self, w):
        return w

    def bprop(self, w, out, dout):
        zero = ops.zeros_like(dout)
        buf = ops.stack([dout if i == self.slot else zero for i in range(self.replicas)])
        return (self.all_reduce(buf)[self.slot],)


class ColumnParallelLinear(nn.Cell):
    """Output features split over TP ranks: weight ``[out/tp, in]`` (``local_out`` overrides out/tp)."""

    def __init__(self, in_features: int, out_features: int, has_bias: bool, rank: RankInfo,
                 compute_dtype=ms.float32, local_out: int | None = None, replicas: int = 0):
        """``replicas`` > 0: the weight is one of ``replicas`` distinct slices, each copied on
        tp / replicas ranks (KV heads when tp > num_key_value_heads); their grads are summed."""
        super().__init__()
        out = local_out if local_out is not None else _divide(out_features, rank.tp, "output features")
        self.dtype = compute_dtype
        self.weight = Parameter(initializer(Normal(0.02), (out, in_features), ms.float32), name="weight")
        self.bias = Parameter(initializer("zeros", (out,), ms.float32), name="bias") if has_bias else None
        self.copy = CopyToTP(rank) if rank.tp > 1 else None
        self.share = SumOverReplicas(rank, replicas) if replicas and rank.tp > replicas else None
        # a LoRA adapter (finetune/model/lora.py) adds its output, from x before CopyToTP
        self.adapter: nn.Cell | None = None

    def construct(self, x):
        y = self._base(self.copy(x) if self.copy is not None else x)
        return y if self.adapter is None else y + self.adapter(x)

    def _base(self, x):
        if self.share is None:
            return linear(x, self.weight, self.bias, self.dtype)
        bias = self.share(self.bias) if self.bias is not None else None
        return linear(x, self.share(self.weight), bias, self.dtype)


class RowParallelLinear(nn.Cell):
    """Input features split over TP ranks: weight ``[out, in/tp]``; partial outputs all-reduced."""

    def __init__(self, in_features: int, out_features: int, has_bias: bool, rank: RankInfo,
                 compute_dtype=ms.float32):
        super().__init__()
        self.dtype = compute_dtype
        local_in = _divide(in_features, rank.tp, "input features")
        self.weight = Parameter(initializer(Normal(0.02), (out_features, local_in), ms.float32), name="weight")
        self.bias = Parameter(initializer("zeros", (out_features,), ms.float32), name="bias") if has_bias else None
        self.reduce = ReduceFromTP(rank) if rank.tp > 1 else None
        self.adapter: nn.Cell | None = None  # a LoRA adapter (finetune/model/lora.py) adds its output

    def construct(self, x):
        y = linear(x, self.weight, None, self.dtype)
        if self.reduce is not None:
            y = self.reduce(y)
        if self.adapter is not None:
            y = y + self.adapter(x)
        if self.bias is not None:
            y = y + self.bias.astype(y.dtype)
        return y
