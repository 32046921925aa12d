"""Requests split over the ranks msrun started (data parallel, each rank a whole model) and their results
gathered in the documents' order, so every rank ends with the numbers one process computes.

Rank ``r`` of ``w`` scores items ``r, r + w, ...`` (lm-eval's split of documents over ranks); the results go
through small JSON files in the results folder (exact floats; the folder is shared by the job's ranks), with
one AllReduce barrier before they are read and one before they are removed.
"""
from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from finetune.dist import RankInfo, barrier, set_device, under_msrun
from jobspec.platform import platform_of

T = TypeVar("T")
R = TypeVar("R")


def join(device: str) -> RankInfo:
    """This process's rank: the world msrun started (collectives initialised), else a single process."""
    platform = platform_of(device)
    target = platform.target
    if not under_msrun():
        return RankInfo(device_target=target)
    from mindspore.communication import GlobalComm, get_group_size, get_rank, init

    set_device(target, int(os.environ.get("DEVICE_ID", "0")) if platform.accelerator else None)
    init()
    rank, world = get_rank(), get_group_size()
    return RankInfo(rank=rank, world_size=world, device_target=target, dp=world, dp_rank=rank,
                    dp_group=GlobalComm.WORLD_COMM_GROUP, world_group=GlobalComm.WORLD_COMM_GROUP)


class Spread:
    """Runs a scoring function on this rank's share of a list and returns every rank's results in order."""

    def __init__(self, rank: RankInfo, folder: Path):
        self.rank, self.folder, self.calls = rank, folder, itertools.count()

    def __call__(self, items: list[T], fn: Callable[[list[T]], list[R]]) -> list[R]:
        r, w = self.rank.rank, self.rank.world_size
        mine = fn(items[r::w])
        if w == 1:
            return mine
        call = next(self.calls)
        part = self.folder / f".dp-{call}-rank{r}.json"
        part.parent.mkdir(parents=True, exist_ok=True)
        part.write_text(json.dumps(mine))
        barrier(self.rank)
        parts: list[Any] = [json.loads((self.folder / f".dp-{call}-rank{k}.json").read_text()) for k in range(w)]
        barrier(self.rank)
        part.unlink()
        out: list[Any] = [None] * len(items)
        for k, got in enumerate(parts):
            out[k::w] = got
        return out
