"""Rank and process-group information for one worker, from the environment msrun gives it.

No distributed globals: :func:`init_distributed` returns a :class:`RankInfo` that is passed on.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


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

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def under_msrun() -> bool:
    """True when msrun started this process (it sets MS_ROLE / MS_WORKER_NUM)."""
    return "MS_ROLE" in os.environ and int(os.environ.get("MS_WORKER_NUM", "1")) >= 1


def init_distributed(tp: int = 1, dp: int = 0, device_target: str = "CPU") -> RankInfo:
    """Initialise collectives when launched by msrun and build the TP/DP groups.

    Single process (no msrun): world 1, no groups, nothing initialised.
    """
    if not under_msrun():
        if tp != 1 or dp not in (0, 1):
            raise ValueError(f"parallel.tp={tp} parallel.dp={dp} need several workers; "
                             "start through the launcher (python -m launcher train) so msrun runs them")
        return RankInfo(device_target=device_target)
    raise NotImplementedError("distributed init is built in finetune/dist.py by the distributed-training work")


def barrier(rank: RankInfo) -> None:
    """Wait for every rank (no-op in a single process)."""
    if rank.world_size == 1:
        return
    raise NotImplementedError("barrier is built by the distributed-training work")
