"""Rank and process-group information for one worker, from the environment msrun gives it.

No distributed globals: :func:`init_distributed` returns a :class:`RankInfo` that is passed on.

msrun 2.10 sets, per worker: ``MS_ROLE=MS_WORKER``, ``MS_WORKER_NUM`` (world size), ``RANK_ID`` and
``MS_NODE_ID`` (global rank), ``RANK_SIZE``, ``DEVICE_ID`` (local index on the node), and
``MS_SCHED_HOST``/``MS_SCHED_PORT``. Layout: rank = dp_rank * tp + tp_rank, so a TP group is ``tp``
contiguous ranks (inside one node when tp divides the local worker count) and a DP group is the
ranks with the same tp_rank.

The layout comes decided in the plan (``recipe.layout``, ``jobspec/layout.py``); a worker only checks
that msrun started the world the plan was made for. The pure-Python parts (group ranks) import no MindSpore;
the collective helpers and the DP transport (``finetune/transport.py``, chosen here once) import it lazily.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from finetune.collectives import all_reduce_sum
from jobspec.layout import Layout
from jobspec.platform import Platform, by_target

if TYPE_CHECKING:
    from finetune.transport import DPTransport


@dataclass(frozen=True)
class RankInfo:
    """Who this process is in the job and which groups it belongs to."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device_target: str = "CPU"  # MindSpore's name of the device; what it decides: ``platform``
    tp: int = 1
    dp: int = 1
    tp_rank: int = 0
    dp_rank: int = 0
    tp_group: str | None = None  # collective group names; None when the size is 1
    dp_group: str | None = None
    world_group: str | None = None  # the backend's world group name once initialised
    transport: DPTransport | None = None  # the DP transport init_distributed chose; None: MindSpore's collectives

    @property
    def platform(self) -> Platform:
        """What this rank's device decides (``jobspec/platform.py``)."""
        return by_target(self.device_target)

    @property
    def dp_comm(self) -> DPTransport:
        """How this rank sums, reduce-scatters and gathers over its DP group (``finetune/transport.py``)."""
        from finetune.transport import collectives

        return self.transport or collectives(self.device_target, self.dp, self.dp_rank, self.dp_group,
                                             self.world_group)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def log(self, msg: str) -> None:
        """The job's one logger: a line on the console from rank 0 (every rank runs the same code)."""
        if self.is_main:
            print(msg, flush=True)


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

    CPU (``Platform.kernels_block``): kernels run when called (``mindspore.runtime.launch_blocking``).
    PyNative's asynchronous dispatch pays off on an NPU, which computes while the host queues; on CPU its
    queue threads spin (``sched_yield``) on the cores that compute: one process trained the bench model 8%
    faster without them, DP 2 18% faster, same losses (docs/speed.md)."""
    import mindspore as ms

    try:
        ms.set_device(target, device_id)
    except RuntimeError:
        if ms.get_current_device().device_target != target:
            raise
    if by_target(target).kernels_block:
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

    set_device(target, local_rank if layout.platform.accelerator else None)  # one NPU per local worker
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

    from finetune.transport import choose

    info = RankInfo(rank=rank, world_size=world, local_rank=local_rank, device_target=target, tp=tp,
                    dp=dp, tp_rank=rank % tp, dp_rank=rank // tp, tp_group=group("tp", tp_group_ranks(rank, tp)),
                    dp_group=group("dp", dp_group_ranks(rank, tp, dp)), world_group=world_group)
    return dataclasses.replace(info, transport=choose(layout, info.dp_rank, info.dp_group, world_group, info.tp_rank,
                                                      info.log))


def barrier(rank: RankInfo) -> None:
    """Wait for every rank (an AllReduce of a scalar over the world; no-op in a single process)."""
    if rank.world_size == 1:
        return
    import mindspore as ms
    import numpy as np

    all_reduce_sum(ms.Tensor(np.ones(1, np.float32)), rank.world_group).asnumpy()


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
