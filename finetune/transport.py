"""The DP transport: how a rank sums, reduce-scatters and gathers over its DP group, chosen once.

``init_distributed`` picks one of three (``choose``) and hangs it on ``RankInfo.transport``; the optimizers
and the gradient code ask it for a ``Channel`` (a fixed set of buckets, reused every step) and never ask
which transport they have:

- ``Native``: MindSpore's ReduceScatter / AllGather / AllReduce on the DP group (Ascend, HCCL);
- ``Emulated``: CPU (MCCL) has no ReduceScatter kernel and AllGather only on the world group, so a
  reduce-scatter is an AllReduce and a slice, a gather (off the world group) an AllReduce of a zero
  buffer holding this rank's chunk: the same sums, more traffic;
- ``SharedMemory``: CPU workers on one node read each other's memory (``finetune/hostcomm.py``,
  ``layout.host_collectives``); gathers of a dtype numpy lacks (bf16) go through ``Emulated``.

Every member must make the same calls in the same order, as with any collective.
"""
from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Callable
from typing import Any, Protocol, cast

import mindspore as ms
import numpy as np
from mindspore import ops

from finetune.collectives import (
    InFlight,
    Ready,
    all_gather_async,
    all_gather_flat,
    all_reduce_sum,
    all_reduce_sum_async,
)
from finetune.collectives import reduce_scatter_sum_async as _reduce_scatter
from finetune.hostcomm import HostGroup, Slots
from finetune.hostmem import own_array
from jobspec.layout import Layout
from jobspec.platform import by_target

Part = tuple[Any, int, int]  # (tensor, start, end) of the tensor's flat view
Target = tuple[Any, int, int, int]  # (parameter, start, end, where that range starts in the gathered bucket)
Write = Callable[[Any, Any], None]  # write(parameter, whole new value)
HOST_DTYPES = {ms.float32: np.float32, ms.float16: np.float16}  # weights a gather moves through numpy


class Flight(Protocol):
    def wait(self) -> Any:
        """The result (a flat fp32 tensor)."""


class Channel(Protocol):
    """Buckets of ``lengths[k]`` elements (each divisible by the DP size when reduce-scattered)."""

    def sum(self, k: int, parts: list[Part]) -> Flight:
        """Start the fp32 sum over DP of bucket ``k`` (``parts`` end to end, zeros after); ``wait()`` gives it
        flat. An fp32 tensor filling the bucket alone may be overwritten with the sum."""

    def reduce_scatter(self, k: int, parts: list[Part]) -> Flight:
        """As ``sum``, but ``wait()`` gives only this rank's chunk (``lengths[k] / size`` elements)."""

    def gather(self, k: int, chunk: Any) -> Any:
        """Every member's ``chunk`` of bucket ``k`` end to end, in member order (a flat tensor)."""

    def start_gather(self, k: int, chunk: Any) -> Flight:
        """``gather(k, chunk)`` started now, ``wait()`` gives it (ZeRO-3's prefetch); done at once where the channel
        is synchronous."""

    def describe_prefetch(self) -> str:
        """Whether the gathers ``start_gather`` starts overlap compute (for the log)."""

    def gather_into(self, k: int, chunk: Any, targets: list[Target], write: Write) -> None:
        """Concatenate every member's ``chunk`` of bucket ``k`` and copy its ranges into ``targets``; a parameter
        is written (``write``) once its last range has arrived (it may span buckets)."""

    def describe(self) -> str:
        """How this channel's reduce-scatter and gather travel (for the log)."""

    @property
    def sent(self) -> int:
        """Bytes this rank has sent so far, counted as native ring collectives send them (:func:`ring_bytes`)."""


class DPTransport(Protocol):
    size: int  # the DP group's size
    index: int  # this rank's place in it

    def channel(self, lengths: list[int], weights: list | None = None, sums: bool = True) -> Channel:
        """A channel of buckets of ``lengths``; ``weights``: the parameters ``gather_into`` writes (a collective
        call for the shared-memory transport); ``sums=False``: it only gathers (no sum buffers)."""


def ring_bytes(whole: int, size: int, times: int = 1) -> int:
    """Bytes a member sends in a ring reduce-scatter or all-gather of ``whole`` bytes over ``size`` members
    (``times`` 2: an all-reduce); ``jobspec.layout_choice.step_traffic`` is the per-step formula."""
    return times * whole * (size - 1) // size


def _flat(parts: list[Part], length: int) -> Any:
    """``parts`` end to end in fp32, zero-padded to ``length``: an fp32 tensor filling it alone is itself. A
    slice is copied (``astype``): with a view of a gradient spanning buckets, the in-place AllReduce of the
    emulated reduce-scatter gave wrong sums on CPU (tests/finetune/dist/test_fp32_grads.py)."""
    out = []
    for t, a, b in parts:
        v = t.reshape(-1)
        whole = (a, b) == (0, v.shape[0])
        out.append(v if whole and v.dtype == ms.float32 else (v if whole else v[a:b]).astype(ms.float32))
    have = sum(int(v.shape[0]) for v in out)
    if have < length:
        out.append(ops.zeros((length - have,), dtype=ms.float32))
    return ops.cat(out) if len(out) > 1 else out[0]


class Collectives:
    """MindSpore's collectives on the DP group; ``native_rs`` / ``native_ag``: the ReduceScatter / AllGather
    kernels exist for it (else their AllReduce equivalents)."""

    native_rs = native_ag = True

    def __init__(self, size: int, index: int, group: str | None):
        self.size, self.index, self.group = size, index, group

    def channel(self, lengths: list[int], weights: list | None = None, sums: bool = True) -> TensorChannel:
        return TensorChannel(self, lengths)


class Native(Collectives):
    """Ascend (HCCL): every collective native on every group."""


class Emulated(Collectives):
    """CPU (MCCL): no ReduceScatter kernel; AllGather only on the world group."""

    native_rs = False

    def __init__(self, size: int, index: int, group: str | None, world_group: str | None):
        super().__init__(size, index, group)
        self.native_ag = group is not None and group == world_group


def _how(native: bool) -> str:
    return "native" if native else "via AllReduce"


def _not_overlapped(why: str) -> str:
    return f"started in the same order, but prefetch is not overlapped on this transport: {why}"


class TensorChannel:
    """A channel over MindSpore's collectives (``Native`` or ``Emulated``)."""

    def __init__(self, t: Collectives, lengths: list[int]):
        self.t, self.lengths = t, list(lengths)
        self.pending: dict[int, list] = {}  # per parameter (id): the gathered pieces of a parameter not yet whole
        self.sent = 0

    def sum(self, k: int, parts: list[Part]) -> Ready | InFlight:
        self.sent += ring_bytes(4 * self.lengths[k], self.t.size, 2)
        return all_reduce_sum_async(_flat(parts, self.lengths[k]), self.t.group)

    def reduce_scatter(self, k: int, parts: list[Part]) -> Ready | InFlight:
        t = self.t
        self.sent += ring_bytes(4 * self.lengths[k], t.size)
        return _reduce_scatter(_flat(parts, self.lengths[k]), t.size, t.index, t.group, t.native_rs)

    def gather(self, k: int, chunk: Any) -> Any:
        t = self.t
        self.sent += ring_bytes(int(chunk.nbytes) * t.size, t.size)
        return all_gather_flat(chunk, t.size, t.index, t.group, t.native_ag)

    def start_gather(self, k: int, chunk: Any) -> Ready | InFlight:
        """On ``Native`` (Ascend) ``all_gather_into_tensor`` on HCCL's stream, beside the compute stream; on
        ``Emulated`` (CPU) MindSpore 2.10 accepts ``async_op`` but runs the collective before the kernels queued
        after it. The same result and bytes as ``gather``."""
        t = self.t
        self.sent += ring_bytes(int(chunk.nbytes) * t.size, t.size)
        return all_gather_async(chunk, t.size, t.index, t.group, t.native_ag, into=isinstance(t, Native))

    def describe_prefetch(self) -> str:
        if isinstance(self.t, Native):
            return "started as asynchronous collectives that overlap the current layer's compute"
        return _not_overlapped("MindSpore's CPU backend runs a collective before the kernels queued after it")

    def gather_into(self, k: int, chunk: Any, targets: list[Target], write: Write) -> None:
        full = self.gather(k, chunk)
        for p, a, b, at in targets:
            self.pending.setdefault(id(p), []).append(full[at:at + b - a])
            if b == int(np.prod(p.shape)):
                pieces = self.pending.pop(id(p))
                flat = ops.cat(pieces) if len(pieces) > 1 else pieces[0]
                write(p, flat.reshape(p.shape))

    def describe(self) -> str:
        return f"reduce-scatter {_how(self.t.native_rs)}, all-gather {_how(self.t.native_ag)}"


class HostSum:
    """One bucket's DP sum through shared memory: ``pieces`` are posted now, the sum is taken at ``wait`` (or at a
    later post that needs its region), which gives elements [lo, hi) of it as one fp32 tensor on a new array."""

    def __init__(self, slots: Slots, k: int, pieces: list[np.ndarray], lo: int = 0, hi: int | None = None):
        self.slots, self.k, self.lo, self.hi = slots, k, lo, hi
        slots.post(k, pieces, None if hi is None else (lo, hi))  # a chunk: no peer reads it

    def wait(self) -> ms.Tensor:
        return ms.from_numpy(self.slots.sum(self.k, self.lo, self.hi))


def host_fp32(t: ms.Tensor) -> np.ndarray:
    """``t`` flat in fp32 as an ndarray: its own memory where ``asnumpy`` shares it (CPU), else a copy."""
    a = t.asnumpy().reshape(-1)
    return a if a.dtype == np.float32 else a.astype(np.float32)


class SharedMemory:
    """CPU workers of one node: sums and gathers through ``/dev/shm`` (``finetune/hostcomm.py``)."""

    def __init__(self, group: HostGroup, fallback: Collectives):
        self.group, self.fallback = group, fallback
        self.size, self.index = group.members, group.index

    def channel(self, lengths: list[int], weights: list | None = None, sums: bool = True) -> HostChannel:
        return HostChannel(self, lengths, weights or [], sums)


class HostChannel:
    """A channel through shared memory; its gathers write straight into the parameters' own memory when they
    share one dtype numpy has and every one owns its memory (else through the fallback's collectives)."""

    def __init__(self, t: SharedMemory, lengths: list[int], weights: list, sums: bool = True):
        self.t, self.lengths = t, list(lengths)
        self.sums = t.group.slots(self.lengths) if sums else None  # None: a gather-only channel
        dtypes = {p.dtype for p in weights}
        dtype = HOST_DTYPES.get(dtypes.pop()) if len(dtypes) == 1 else None
        own = all(own_array(p) is not None for p in weights)
        self.gathers = t.group.slots([n // t.size for n in self.lengths], dtype) if dtype and own else None
        self.other = t.fallback.channel(lengths)
        self.own = 0  # bytes sent through shared memory (the fallback counts its own)

    @property
    def sent(self) -> int:
        return self.own + self.other.sent

    def _sums(self) -> Slots:
        if self.sums is None:
            raise RuntimeError("a gather-only channel (sums=False) cannot sum")
        return self.sums

    def sum(self, k: int, parts: list[Part]) -> HostSum:
        self.own += ring_bytes(4 * self.lengths[k], self.t.size, 2)
        return HostSum(self._sums(), k, [host_fp32(x)[a:b] for x, a, b in parts])

    def reduce_scatter(self, k: int, parts: list[Part]) -> HostSum:
        c, r = self.lengths[k] // self.t.size, self.t.index
        self.own += ring_bytes(4 * self.lengths[k], self.t.size)
        return HostSum(self._sums(), k, [host_fp32(x)[a:b] for x, a, b in parts], r * c, (r + 1) * c)

    def gather(self, k: int, chunk: Any) -> Any:
        if self.gathers is None:
            return self.other.gather(k, chunk)
        self.own += ring_bytes(int(chunk.nbytes) * self.t.size, self.t.size)
        self.gathers.post(k, [chunk.asnumpy()])
        whole = np.concatenate(self.gathers.views(k))
        self.gathers.done(k)
        return ms.from_numpy(whole)

    def gather_into(self, k: int, chunk: Any, targets: list[Target], write: Write) -> None:
        """Each member's chunk copied straight into the parameters' own memory (an in-place write, as
        ``write``'s)."""
        if self.gathers is None:
            self.other.gather_into(k, chunk, targets, write)
            return
        dest = [own_array(p) for p, _, _, _ in targets]
        if any(d is None for d in dest):  # every parameter had its own memory when the channel was made
            raise RuntimeError(f"bucket {k}: a parameter no longer owns its memory (replaced by set_data?); every "
                               "writer must write weights in place; OVERRIDES='parallel.host_collectives=false' "
                               "avoids this path")
        slots, c = self.gathers, self.lengths[k] // self.t.size
        self.own += ring_bytes(int(chunk.nbytes) * self.t.size, self.t.size)
        slots.post(k, [chunk.asnumpy()])
        views = slots.views(k)
        for (_, a, b, at), d in zip(targets, dest):
            flat = cast(np.ndarray, d).reshape(-1)
            while a < b:
                m, off = divmod(at, c)
                n = min(b - a, c - off)
                flat[a:a + n] = views[m][off:off + n]
                a, at = a + n, at + n
        slots.done(k)

    def start_gather(self, k: int, chunk: Any) -> Ready:
        """A copy on the calling thread: done when started."""
        return Ready(self.gather(k, chunk))

    def describe_prefetch(self) -> str:
        return _not_overlapped("its gathers are synchronous copies through shared memory")

    def describe(self) -> str:
        return "reduce-scatter through shared memory, all-gather " + (
            "through shared memory" if self.gathers is not None else _how(self.t.fallback.native_ag))


def collectives(device_target: str, size: int, index: int, group: str | None, world_group: str | None
                ) -> Collectives:
    """MindSpore's collectives for a DP group: native on Ascend, emulated where the CPU backend lacks them."""
    if by_target(device_target).native_collectives:
        return Native(size, index, group)
    return Emulated(size, index, group, world_group)


def choose(layout: Layout, index: int, group: str | None, world_group: str | None, tp_rank: int,
           log: Callable[[str], None]) -> DPTransport:
    """The DP transport of the plan's ``layout`` for DP member ``index`` of ``group`` (of TP rank ``tp_rank``);
    shared memory under a name that rank 0 draws for the job (one AllReduce over the world; every DP group
    and every member makes its files under it). ``log``: rank 0's logger."""
    base = collectives(layout.device_target, layout.dp, index, group, world_group)
    if not layout.host_collectives:
        return base
    main = index == 0 and tp_rank == 0
    draw = np.array([secrets.randbelow(1 << 24) if main else 0], np.float32)  # exact in fp32
    token = int(all_reduce_sum(ms.Tensor(draw), world_group).asnumpy()[0])
    shm = os.access("/dev/shm", os.W_OK)
    where = "/dev/shm" if shm else tempfile.gettempdir()
    log(f"[train] DP sums through shared memory in {where} (parallel.host_collectives)" if shm
        else f"[train] warning: /dev/shm is not writable, so the DP sums go through files in {where}, which may "
             "be slower: mount /dev/shm writable (docker run --shm-size=...) or set "
             "parallel.host_collectives=false")
    group_files = os.path.join(where, f"ascend-finetune-{token:06x}-dp{tp_rank}")
    return SharedMemory(HostGroup(group_files, layout.dp, index), base)
