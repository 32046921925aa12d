"""Batches from the token cache: packed, padded or by token budget; deterministic and resumable.

The unit of shuffling is a *row* (packing: a first-fit-decreasing bin of whole samples; no
packing: one sample) or, with ``max_tokens_per_batch``, a *group* of samples whose padded size
fits the budget. Units are made once (they depend only on the cache), and their order per epoch
only on ``seed`` and the epoch, so any dp_size/grad_accum split sees the same global batches.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from jobspec.data.cache import INDEX
from jobspec.data.template import IGNORE


def pack_ffd(lengths: NDArray[Any], capacity: int) -> list[list[int]]:
    """First-fit decreasing: sample indices per bin, each bin's total length <= capacity.

    A max segment tree over the bins' free space finds the first bin that fits in O(log n).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    if n == 0:
        return []
    if int(lengths.max()) > capacity:
        raise ValueError(f"a sample of {int(lengths.max())} tokens exceeds the row size {capacity}")
    size = 1 << max(n - 1, 1).bit_length()
    tree = [0] * size + [capacity] * n + [0] * (size - n)
    for i in range(size - 1, 0, -1):
        tree[i] = max(tree[2 * i], tree[2 * i + 1])
    order = np.argsort(-lengths, kind="stable").tolist()
    lens = lengths.tolist()
    bins: list[list[int]] = []
    for idx in order:
        need = lens[idx]
        i = 1
        while i < size:
            i = 2 * i if tree[2 * i] >= need else 2 * i + 1
        b = i - size
        if b == len(bins):
            bins.append([])
        bins[b].append(idx)
        tree[i] -= need
        i >>= 1
        while i:
            m = max(tree[2 * i], tree[2 * i + 1])
            if tree[i] == m:
                break
            tree[i] = m
            i >>= 1
    return bins


def group_by_budget(lengths: NDArray[Any], budget: int) -> list[list[int]]:
    """Dynamic batching: samples sorted by length, grouped while count x max length <= budget."""
    order = np.argsort(np.asarray(lengths), kind="stable").tolist()
    groups: list[list[int]] = []
    cur: list[int] = []
    for idx in order:
        if cur and (len(cur) + 1) * int(lengths[idx]) > budget:
            groups.append(cur)
            cur = []
        cur.append(idx)
    if cur:
        groups.append(cur)
    return groups


def efficiency(units: list[list[int]], lengths: NDArray[Any], width: int | None = None) -> float:
    """Real tokens / token slots (rows of ``width``, or each group padded to its longest)."""
    real = slots = 0
    for u in units:
        ls = [int(lengths[i]) for i in u]
        real += sum(ls)
        slots += width if width else len(ls) * max(ls)
    return real / slots if slots else 0.0


@dataclass
class Step:
    """One optimizer step for this dp rank."""

    micro_batches: list[dict[str, NDArray[Any]]]  # grad_accum dicts of int32 [mbs, seq]
    global_label_tokens: int  # count(labels[:, 1:] != -100) over the whole global batch
    epoch: int
    index: int  # step within the epoch


class BatchLoader:
    """Deterministic, resumable batches from a token cache (see the module doc).

    Global batch: micro_batch_size x grad_accum x dp_size rows per step; micro-batch j of dp rank r
    is rows [r*mbs, (r+1)*mbs) of the j-th global micro-batch. With max_tokens_per_batch > 0 a
    micro-batch is one budget group (micro_batch_size is not used; shapes vary), and rank r's j-th
    micro-batch is group j*dp_size + r of the step. An incomplete last global batch is dropped.
    """

    def __init__(self, cache_dir: str | Path, seq_len: int, micro_batch_size: int, grad_accum: int,
                 dp_size: int, dp_rank: int, seed: int, packing: bool = True,
                 max_tokens_per_batch: int = 0, epochs: int = 1, index_name: str = INDEX):
        """``index_name``: the cache's sample index to read (``val_index.npy`` for the validation set)."""
        cache_dir = Path(cache_dir)
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        manifest = json.loads((cache_dir / "manifest.json").read_text())
        self.pad_id = int(manifest.get("pad_id", 0))
        self.tokens = np.load(cache_dir / "tokens.npy", mmap_mode="r")
        self.labels = np.load(cache_dir / "labels.npy", mmap_mode="r")
        self.index = np.load(cache_dir / index_name)
        self.seq_len, self.mbs, self.ga = seq_len, micro_batch_size, grad_accum
        self.dp_size, self.dp_rank, self.seed, self.epochs = dp_size, dp_rank, seed, epochs
        self.dynamic = max_tokens_per_batch > 0
        lengths = self.index[:, 1]
        if len(lengths) and int(lengths.max()) > seq_len:
            raise ValueError(f"{cache_dir}: samples up to {int(lengths.max())} tokens but seq_len={seq_len}; "
                             "prepare the cache with the same data.seq_len")
        if self.dynamic:
            self.units = group_by_budget(lengths, max_tokens_per_batch)
            per_step = grad_accum * dp_size
        else:
            self.units = pack_ffd(lengths, seq_len) if packing else [[i] for i in range(len(lengths))]
            per_step = micro_batch_size * grad_accum * dp_size
        self.per_step = per_step
        # shifted label count of each unit: a packed row loses only its first token's label
        shifted, label0 = self.index[:, 2], self.index[:, 3]
        self.unit_labels = np.array([int(shifted[u].sum() + label0[u].sum() - label0[u[0]]) if not self.dynamic
                                     else int(shifted[u].sum()) for u in self.units], dtype=np.int64)
        self.steps_per_epoch = len(self.units) // per_step
        self.total_steps = self.epochs * self.steps_per_epoch
        self._epoch, self._index = 0, 0
        self._order_cache: tuple[int, NDArray[Any]] | None = None

    def _order(self, epoch: int) -> NDArray[Any]:
        if self._order_cache is None or self._order_cache[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order_cache = (epoch, rng.permutation(len(self.units)))
        return self._order_cache[1]

    def _rows(self, units: list[list[int]], width: int) -> dict[str, NDArray[Any]]:
        n = len(units)
        ids = np.full((n, width), self.pad_id, dtype=np.int32)
        lab = np.full((n, width), IGNORE, dtype=np.int32)
        pos = np.zeros((n, width), dtype=np.int32)
        seg = np.zeros((n, width), dtype=np.int32)
        for r, unit in enumerate(units):
            o = 0
            for k, s in enumerate(unit, 1):
                start, length = int(self.index[s, 0]), int(self.index[s, 1])
                ids[r, o:o + length] = self.tokens[start:start + length]
                lab[r, o:o + length] = self.labels[start:start + length]
                pos[r, o:o + length] = np.arange(length)
                seg[r, o:o + length] = k
                o += length
        return {"input_ids": ids, "labels": lab, "position_ids": pos, "segment_ids": seg}

    def _step(self, epoch: int, index: int) -> Step:
        chosen = self._order(epoch)[index * self.per_step:(index + 1) * self.per_step]
        micro = []
        for j in range(self.ga):
            if self.dynamic:
                unit = self.units[int(chosen[j * self.dp_size + self.dp_rank])]
                width = max(int(self.index[s, 1]) for s in unit)
                micro.append(self._rows([[s] for s in unit], width))
            else:
                block = chosen[j * self.mbs * self.dp_size:(j + 1) * self.mbs * self.dp_size]
                mine = block[self.dp_rank * self.mbs:(self.dp_rank + 1) * self.mbs]
                micro.append(self._rows([self.units[int(u)] for u in mine], self.seq_len))
        return Step(micro, int(self.unit_labels[chosen].sum()), epoch, index)

    def eval_micro_batches(self, lockstep: bool = False) -> Iterator[dict[str, NDArray[Any]]]:
        """Every unit exactly once, in cache order, for evaluation: unit i belongs to DP rank
        i % dp_size; this rank's units in micro-batches of micro_batch_size rows (one budget group
        each with max_tokens_per_batch). No shuffling, nothing dropped. A short last micro-batch gets
        empty rows (no labels): every batch has the training shape, so a compiled layer compiles once.
        ``lockstep``: as many micro-batches as DP rank 0 (which has the most), the missing ones its first
        without labels (nothing counted): every DP rank runs the same forwards (ZeRO-3 gathers in each)."""
        yield from self._eval_rows(self.dp_rank)
        missing = self._eval_count(0) - self._eval_count(self.dp_rank)
        if lockstep and missing:
            first = next(self._eval_rows(0))
            blank = {**first, "labels": np.full_like(first["labels"], IGNORE)}
            for _ in range(missing):
                yield blank

    def _eval_count(self, dp_rank: int) -> int:
        units = len(self.units[dp_rank::self.dp_size])
        return units if self.dynamic else -(-units // self.mbs)

    def _eval_rows(self, dp_rank: int) -> Iterator[dict[str, NDArray[Any]]]:
        mine = self.units[dp_rank::self.dp_size]
        if self.dynamic:
            for unit in mine:
                yield self._rows([[s] for s in unit], max(int(self.index[s, 1]) for s in unit))
            return
        for a in range(0, len(mine), self.mbs):
            rows = mine[a:a + self.mbs]
            yield self._rows(rows + [[]] * (self.mbs - len(rows)), self.seq_len)

    def __len__(self) -> int:
        return self.total_steps

    def __iter__(self) -> Iterator[Step]:
        while self._epoch < self.epochs:
            while self._index < self.steps_per_epoch:
                step = self._step(self._epoch, self._index)
                self._index += 1  # the yielded step counts as consumed
                yield step
            self._epoch, self._index = self._epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """Position after the last yielded step (JSON-able)."""
        return {"epoch": self._epoch, "index": self._index, "seed": self.seed,
                "num_units": len(self.units), "per_step": self.per_step}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Continue from a state_dict(); the remaining steps equal the uninterrupted run's."""
        if d.get("seed", self.seed) != self.seed or d.get("num_units", len(self.units)) != len(self.units) \
                or d.get("per_step", self.per_step) != self.per_step:
            raise ValueError(f"data position {d} does not match this loader (seed={self.seed}, "
                             f"units={len(self.units)}, sequences per step={self.per_step}): the data, "
                             "seq_len, packing or global batch size changed since the checkpoint")
        self._epoch, self._index = int(d["epoch"]), int(d["index"])
