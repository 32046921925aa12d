"""Rank and process-group information for one worker, from the environment msrun gives it.

No distributed globals: :func:`init_distributed` returns a :class:`RankInfo` that is passed on.

msrun 2.10 sets, per worker: ``MS_ROLE=MS_WORKER``, ``MS_WORKER_NUM`` (world size), ``RANK_ID`` and
``MS_NODE_ID`` (global rank), ``RANK_SIZE``, ``DEVICE_ID`` (local index on the node), and
``MS_SCHED_HOST``/``MS_SCHED_PORT``. Layout: rank = dp_rank * tp + tp_rank, so a TP group is ``tp``
contiguous ranks (inside one node when tp divides the local worker count) and a DP group is the
ranks with the same tp_rank.

The layout comes decided in the plan (``recipe.layout``, ``jobspec/layout.py``); a worker only checks
that msrun started the world the plan was made for. The pure-Python parts (group ranks) import no MindSpore;
the collective helpers import it lazily.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import secrets
import tempfile
from dataclasses import dataclass
from typing import Any, cast

from finetune.parallel.hostcomm import HostGroup
from jobspec.layout import Device, Layout


@dataclass(frozen=True)
class RankInfo:
    """Who this process is in the job and which groups it belongs to."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device_target: str = "CPU"  # "CPU" or "Ascend"
    tp: int = 1
    dp: int = 1
    tp_rank: int = 0
    dp_rank: int = 0
    tp_group: str | None = None  # collective group names; None when the size is 1
    dp_group: str | None = None
    world_group: str | None = None  # the backend's world group name once initialised
    dp_host: HostGroup | None = None  # the DP group through shared memory (layout.host_collectives)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def log(self, msg: str) -> None:
        """The job's one logger: a line on the console from rank 0 (every rank runs the same code)."""
        if self.is_main:
            print(msg, flush=True)


def launch_device(setting: str) -> Device:
    """'npu' or 'cpu' from launch.device (auto: npu when /dev/davinciN exists)."""
    if setting in ("npu", "cpu"):
        return cast(Device, setting)
    return "npu" if glob.glob("/dev/davinci[0-9]*") else "cpu"


def device_target(setting: str) -> str:
    """MindSpore's device name ('Ascend' or 'CPU') for launch.device."""
    return Layout(device=launch_device(setting)).device_target


def under_msrun() -> bool:
    """True when msrun started this process (it sets MS_ROLE / MS_WORKER_NUM)."""
    return "MS_ROLE" in os.environ and int(os.environ.get("MS_WORKER_NUM", "1")) >= 1


def launched_world() -> int:
    """The number of workers msrun started (1 without msrun)."""
    return int(os.environ["MS_WORKER_NUM"]) if under_msrun() else 1


def check_world(world: int, layout: Layout) -> None:
    """ValueError naming the fix unless the plan's layout is the world msrun started."""
    problem = layout.world_problem(world, layout.device)
    if problem:
        raise ValueError(problem)


def tp_group_ranks(rank: int, tp: int) -> list[int]:
    """The ``tp`` contiguous global ranks that share ``rank``'s model slices."""
    start = rank - rank % tp
    return list(range(start, start + tp))


def dp_group_ranks(rank: int, tp: int, dp: int) -> list[int]:
    """The ``dp`` global ranks holding the same TP slice as ``rank`` (equal tp_rank)."""
    return [rank % tp + j * tp for j in range(dp)]


def group_name(kind: str, ranks: list[int]) -> str:
    """Stable group name from its members, e.g. ``tp-0-1`` or ``dp-1-3``."""
    return f"{kind}-" + "-".join(str(r) for r in ranks)


def set_device(target: str, device_id: int | None) -> None:
    """``mindspore.set_device`` (before any kernel runs and before ``init()``), tolerating a process
    that already runs kernels on that target (tests that train several times in one process).

    CPU: kernels run when called (``mindspore.runtime.launch_blocking``). PyNative's asynchronous dispatch
    pays off on an NPU, which computes while the host queues; on CPU its queue threads spin
    (``sched_yield``) on the cores that compute: one process trained the bench model 8% faster without
    them, DP 2 18% faster, same losses (docs/speed.md)."""
    import mindspore as ms

    try:
        ms.set_device(target, device_id)
    except RuntimeError:
        if ms.get_current_device().device_target != target:
            raise
    if target == "CPU":
        ms.runtime.launch_blocking()


def init_distributed(layout: Layout) -> RankInfo:
    """Initialise collectives when launched by msrun and build the TP/DP groups of the plan's layout.

    Single process (no msrun): world 1, no groups, nothing initialised. A group spanning all ranks
    is the backend's world group (not a created sub-group), so world-only collectives can use it.
    """
    world_env, tp, dp, target = launched_world(), layout.tp, layout.dp, layout.device_target
    check_world(world_env, layout)  # fail fast, before connecting to anyone
    if not under_msrun():
        set_device(target, None)
        return RankInfo(device_target=target)
    local_rank = int(os.environ.get("DEVICE_ID", "0"))

    from mindspore.communication import GlobalComm, create_group, get_group_size, get_rank, init

    set_device(target, local_rank if target == "Ascend" else None)  # one NPU per local worker
    init()
    rank, world = get_rank(), get_group_size()
    if world != world_env:
        raise RuntimeError(f"collective world size {world} != MS_WORKER_NUM={world_env}")
    try:
        from mindspore.communication import get_local_rank

        local_rank = get_local_rank()
    except (RuntimeError, ValueError):  # some backends do not know it; DEVICE_ID is the local index
        pass
    world_group = GlobalComm.WORLD_COMM_GROUP

    def group(kind: str, ranks: list[int]) -> str | None:
        if len(ranks) == 1:
            return None
        if len(ranks) == world:
            return world_group
        name = group_name(kind, ranks)
        create_group(name, ranks)
        return name

    info = RankInfo(rank=rank, world_size=world, local_rank=local_rank, device_target=target, tp=tp,
                    dp=dp, tp_rank=rank % tp, dp_rank=rank // tp, tp_group=group("tp", tp_group_ranks(rank, tp)),
                    dp_group=group("dp", dp_group_ranks(rank, tp, dp)), world_group=world_group)
    return dataclasses.replace(info, dp_host=host_group(info)) if layout.host_collectives else info


def host_group(rank: RankInfo) -> HostGroup:
    """This rank's DP group through shared memory, under a name rank 0 draws for the job (one AllReduce
    over the world; every DP group and every member makes its files under it)."""
    import mindspore as ms
    import numpy as np

    draw = np.array([secrets.randbelow(1 << 24) if rank.is_main else 0], np.float32)  # exact in fp32
    token = int(all_reduce_sum(ms.Tensor(draw), rank.world_group).asnumpy()[0])
    shm = os.access("/dev/shm", os.W_OK)
    where = "/dev/shm" if shm else tempfile.gettempdir()
    group = HostGroup(os.path.join(where, f"ascend-finetune-{token:06x}-dp{rank.tp_rank}"), rank.dp, rank.dp_rank)
    rank.log(f"[train] DP sums through shared memory in {where} (parallel.host_collectives)" if shm
             else f"[train] warning: /dev/shm is not writable, so the DP sums go through files in {where}, which may "
                  "be slower: mount /dev/shm writable (docker run --shm-size=...) or set "
                  "parallel.host_collectives=false")
    return group


# ------------------------------------------------------------------------------------- collectives

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


def barrier(rank: RankInfo) -> None:
    """Wait for every rank (an AllReduce of a scalar over the world; no-op in a single process)."""
    if rank.world_size == 1:
        return
    import mindspore as ms
    import numpy as np

    all_reduce_sum(ms.Tensor(np.ones(1, np.float32)), rank.world_group).asnumpy()


def native_collectives(rank: RankInfo, group: str | None) -> dict[str, bool]:
    """Which of AllGather / ReduceScatter the backend has for ``group``.

    Ascend (HCCL) has both on every group. The CPU backend (MCCL) has AllGather only on the world
    group and no ReduceScatter kernel at all; there the AllReduce-based equivalents are used.
    """
    if rank.device_target == "Ascend":
        return {"allgather": True, "reducescatter": True}
    return {"allgather": group is not None and group == rank.world_group, "reducescatter": False}


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
    from mindspore import ops

    n = chunk.shape[0]
    parts = [ops.zeros((index * n,), dtype=chunk.dtype), chunk, ops.zeros(((size - index - 1) * n,), dtype=chunk.dtype)]
    return all_reduce_sum(ops.cat([p for p in parts if p.shape[0]]), group)


def dp_totals(loss: Any, count: int, flag: bool, rank: RankInfo, same: Any = None
              ) -> tuple[float, int, bool, list[float]]:
    """(``loss`` summed over DP, ``count`` summed over DP, ``flag`` set on any rank, the values of
    ``same``) in one fp32 all-reduce over the world (TP ranks hold equal copies of loss and count) and
    one host read. ``same``: a 1-D fp32 device tensor equal on every rank, read as it is. The count
    travels as two base-4096 digits, each sum exact in fp32 (the CPU backend reduces only floats)."""
    import mindspore as ms
    import numpy as np
    from mindspore import ops

    local = loss.astype(ms.float32).reshape(1)
    if rank.world_size > 1:
        digits = ms.Tensor(np.array([count // 4096, count % 4096, float(flag)], np.float32))
        local = all_reduce_sum(ops.cat([local, digits]), rank.world_group)
    values = (local if same is None else ops.cat([local, same])).asnumpy().tolist()
    if rank.world_size == 1:
        return values[0], count, flag, values[1:]
    loss_sum, hi, lo, flags = values[:4]
    return loss_sum / rank.tp, (int(hi) * 4096 + int(lo)) // rank.tp, flags > 0, values[4:]
