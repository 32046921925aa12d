"""MindSpore's collectives over a named group, as the DP transports and the runtime call them.

A group of one is ``None``: every helper then returns its input without a collective. The asynchronous
helpers return an object whose ``wait()`` gives the result (``Ready`` or ``InFlight``). Which of these a DP
reduction uses is the DP transport's choice (``finetune/transport.py``), made once.
"""
from __future__ import annotations

from typing import Any

_PRIMS: dict[tuple[str, str], Any] = {}  # cached primitive per (op, group): creating one per call is slow


def _prim(op: str, group: str) -> Any:
    from mindspore import ops

    key = (op, group)
    if key not in _PRIMS:
        _PRIMS[key] = {"allreduce": lambda: ops.AllReduce(group=group),
                       "allgather": lambda: ops.AllGather(group=group)}[op]()
    return _PRIMS[key]


def all_reduce_sum(x: Any, group: str | None) -> Any:
    """Sum of ``x`` over ``group`` (identity when the group is None, i.e. of size 1)."""
    if group is None:
        return x
    return _prim("allreduce", group)(x)


class Ready:
    """A result that needed no collective (a group of one): ``wait`` returns it."""

    def __init__(self, value: Any):
        self.value = value

    def wait(self) -> Any:
        return self.value


class InFlight:
    """An asynchronous collective writing into ``out``: ``wait`` waits for it and returns ``out[lo:hi]``.

    It keeps every buffer handed to the collective (``out`` and ``inputs``) referenced until ``wait``
    returns, as MindSpore's own DistributedDataParallel does: a buffer freed while the collective still
    reads it could be reused by a later kernel (docs/ascend-contracts.md, "buffer lifetime")."""

    def __init__(self, handle: Any, out: Any, lo: int = 0, hi: int | None = None, inputs: tuple = ()):
        self.handle, self.out, self.lo, self.hi, self.inputs = handle, out, lo, hi, inputs

    def wait(self) -> Any:
        self.handle.wait()
        self.inputs = ()
        return self.out if self.lo == 0 and self.hi is None else self.out[self.lo:self.hi]


def all_reduce_sum_async(buf: Any, group: str | None, lo: int = 0, hi: int | None = None) -> Ready | InFlight:
    """Start summing the 1-D ``buf`` over ``group`` IN PLACE (``mint.distributed.all_reduce`` with
    ``async_op=True``: on Ascend it runs on the communication stream while later kernels run);
    ``wait()`` gives the sum's ``[lo:hi]``. ``buf`` must be a buffer no one else reads."""
    if group is None:
        return Ready(buf if lo == 0 and hi is None else buf[lo:hi])
    from mindspore.mint import distributed

    return InFlight(distributed.all_reduce(buf, op="sum", group=group, async_op=True), buf, lo, hi)


def reduce_scatter_sum_async(buf: Any, size: int, index: int, group: str | None, native: bool) -> Ready | InFlight:
    """Start summing the 1-D ``buf`` (length divisible by ``size``) over ``group``; ``wait()`` gives
    chunk ``index`` of the sum. ``buf`` must be a buffer no one else reads.

    ``native=False``: an AllReduce of ``buf``, then the slice (same sums; more traffic, used where
    ReduceScatter is missing).
    """
    if group is None:
        return Ready(buf)
    n = buf.shape[0] // size
    if not native:
        return all_reduce_sum_async(buf, group, index * n, (index + 1) * n)
    from mindspore import ops
    from mindspore.mint import distributed

    out = ops.zeros((n,), dtype=buf.dtype)
    return InFlight(distributed.reduce_scatter_tensor(out, buf, op="sum", group=group, async_op=True), out,
                    inputs=(buf,))


def all_gather_flat(chunk: Any, size: int, index: int, group: str | None, native: bool) -> Any:
    """Concatenate every member's 1-D ``chunk`` in group order.

    ``native=False``: place this chunk into a zero buffer and AllReduce-sum it (exact: x + 0 = x).
    """
    if group is None:
        return chunk
    if native:
        return _prim("allgather", group)(chunk)
    return all_reduce_sum(_placed(chunk, size, index), group)


def _placed(chunk: Any, size: int, index: int) -> Any:
    """A zero buffer of ``size`` chunks holding ``chunk`` as chunk ``index`` (an emulated gather's summand)."""
    from mindspore import ops

    n = chunk.shape[0]
    zeros = [ops.zeros((m,), dtype=chunk.dtype) for m in (index * n, (size - index - 1) * n)]
    parts = [zeros[0], chunk, zeros[1]]
    return ops.cat([p for p in parts if p.shape[0]])


class Gathering(InFlight):
    """An asynchronous all-gather into one buffer per member: ``wait`` gives them end to end (and drops them)."""

    def wait(self) -> Any:
        from mindspore import ops

        parts, self.out = super().wait(), []
        return ops.cat(parts)


def all_gather_async(chunk: Any, size: int, index: int, group: str | None, native: bool, into: bool
                     ) -> Ready | InFlight:
    """Start :func:`all_gather_flat` (same result) as an asynchronous collective; ``wait()`` gives it.

    ``native`` and ``into`` (HCCL): ``mint.distributed.all_gather_into_tensor`` into one flat buffer; ``native``
    alone: ``mint.distributed.all_gather`` into one buffer per member, concatenated at ``wait`` (MindSpore 2.10's
    CPU backend has no kernel for the former: "DistCommAllGatherIntoTensor unregistered"); else the AllReduce of
    :func:`_placed`, started with ``all_reduce_sum_async``.
    """
    if group is None:
        return Ready(chunk)
    if not native:
        return all_reduce_sum_async(_placed(chunk, size, index), group)
    from mindspore import ops
    from mindspore.mint import distributed

    if into:
        out = ops.zeros((size * chunk.shape[0],), dtype=chunk.dtype)
        return InFlight(distributed.all_gather_into_tensor(out, chunk, group=group, async_op=True), out,
                        inputs=(chunk,))
    outs = [ops.zeros_like(chunk) for _ in range(size)]
    return Gathering(distributed.all_gather(outs, chunk, group=group, async_op=True), outs, inputs=(chunk,))
