"""Requests split over the DP ranks msrun started (each DP rank a whole model, split over its TP ranks as training
splits it) and their results gathered in the documents' order, so every rank ends with the numbers one process
computes.

DP rank ``r`` of ``w`` scores items ``r, r + w, ...`` (lm-eval's split of documents over ranks); the results go
through small JSON files in the results folder (exact floats; the folder is shared by the job's ranks), written
by each DP group's TP rank 0, with one AllReduce barrier before they are read and one before they are removed.
"""
from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from finetune.dist import RankInfo, barrier, init_distributed, launched_world
from jobspec.layout import Layout
from jobspec.platform import platform_of

T = TypeVar("T")
R = TypeVar("R")


def join(device: str, tp: int = 1) -> RankInfo:
    """This process's rank in the world msrun started, TP ``tp`` x DP the rest (``finetune.dist.init_distributed``,
    its world check included; ``tp`` divides the world, see :func:`tp_problem`), else a single process."""
    return init_distributed(Layout(tp=tp, dp=launched_world() // tp, device=platform_of(device).device))


def tp_problem(tp: int) -> str | None:
    """Why ``--tp`` cannot split the world msrun started, or None."""
    world = launched_world()
    if tp >= 1 and world % tp == 0:
        return None
    return f"--tp {tp} (parallel.tp) does not divide the {world} worker(s) of this job; e.g. --tp 1"


class Spread:
    """Runs a scoring function on this rank's share of a list and returns every rank's results in order."""

    def __init__(self, rank: RankInfo, folder: Path):
        self.rank, self.folder, self.calls = rank, folder, itertools.count()

    def __call__(self, items: list[T], fn: Callable[[list[T]], list[R]]) -> list[R]:
        r, w = self.rank.dp_rank, self.rank.dp
        mine = fn(items[r::w])  # the TP ranks of a DP group compute it together
        if w == 1:
            return mine
        call = next(self.calls)
        part = self.folder / f".dp-{call}-rank{r}.json"
        writer = self.rank.tp_rank == 0
        if writer:
            part.parent.mkdir(parents=True, exist_ok=True)
            part.write_text(json.dumps(mine))
        barrier(self.rank)
        parts: list[Any] = [json.loads((self.folder / f".dp-{call}-rank{k}.json").read_text()) for k in range(w)]
        barrier(self.rank)
        if writer:
            part.unlink()
        out: list[Any] = [None] * len(items)
        for k, got in enumerate(parts):
            out[k::w] = got
        return out
