"""Checkpoint tensors across TP x DP layouts (numpy only; no mindspore).

A checkpoint holds each rank's local tensors (``finetune/io/checkpoint.py``): the model once per TP
position (the ranks of dp_rank 0, ``rank == tp_rank``), the optimizer state per rank when sharded
over DP (flat buckets cut into ``dp`` chunks, ``jobspec/shard_layout.py``), else once per TP
position. :class:`SavedState` reassembles full Hugging Face tensors from any of them; the slice a
rank held is read off the stored shapes (``n = full / local`` pieces along the one axis that
differs, KV-head copies on ``tp / n`` ranks each), so no config of the writing run is needed.
:func:`local_state` cuts full tensors for a rank of another layout.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
from safetensors import safe_open

from jobspec.model_layout import TPSlice
from jobspec.shard_layout import LAYOUT_KEY, ShardLayout, state_key

MANIFEST = "manifest.json"


def rank_file(step_dir: Path, kind: str, rank: int) -> Path:
    """``model_rank00003.safetensors`` / ``optim_rank00003.safetensors`` of a checkpoint."""
    return Path(step_dir) / f"{kind}_rank{rank:05d}.safetensors"


def cut(full: np.ndarray, part: TPSlice | None) -> np.ndarray:
    """This rank's slice of a full tensor (the whole tensor when ``part`` is None)."""
    if part is None:
        return full
    index = [slice(None)] * full.ndim
    index[part.axis] = slice(part.start, part.start + part.size)
    return np.ascontiguousarray(full[tuple(index)])


def _read(path: Path, key: str, index: tuple | None = None) -> np.ndarray:
    with safe_open(str(path), framework="numpy") as f:
        return np.asarray(f.get_slice(key)[index] if index is not None else f.get_tensor(key))


def _keys(path: Path) -> dict[str, list[int]]:
    with safe_open(str(path), framework="numpy") as f:
        return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}


class SavedState:
    """Full tensors of a checkpoint written under any layout.

    ``names``: the model's parameter names in model order (the sharded optimizer's flat order);
    ``full``: their full shapes (``jobspec.model_layout``).
    """

    def __init__(self, path: Path, names: list[str], full: dict[str, tuple[int, ...]], bucket_bytes: int):
        self.path = Path(path)
        layout = json.loads((self.path / MANIFEST).read_text())["layout"]
        self.tp, self.dp = int(layout["tp"]), int(layout["dp"])
        self.names, self.full = names, full
        self.local = [_keys(rank_file(self.path, "model", t)) for t in range(self.tp)]
        wrong = [f"{n} {self.local[0].get(n)}" for n in names if not self._fits(n)]
        if wrong:
            raise ValueError(f"{self.path}: tensors do not fit this model ({'; '.join(wrong[:3])}); the checkpoint "
                             "belongs to another model — point train.resume / --checkpoint at one of this model")
        self.optim_keys = _keys(rank_file(self.path, "optim", 0))
        self.sharded = LAYOUT_KEY in self.optim_keys
        self.bucket_bytes = bucket_bytes

    def _fits(self, name: str) -> bool:
        local, full = self.local[0].get(name), self.full[name]
        if local is None or len(local) != len(full):
            return False
        diff = [a for a, (lo, fu) in enumerate(zip(local, full)) if lo != fu]
        return not diff or (len(diff) == 1 and full[diff[0]] % local[diff[0]] == 0
                            and self.tp % (full[diff[0]] // local[diff[0]]) == 0)

    def part(self, name: str, tp_rank: int) -> TPSlice | None:
        """The slice TP rank ``tp_rank`` of the writing run held (None: the whole tensor)."""
        local, full = self.local[tp_rank][name], self.full[name]
        diff = [a for a, (lo, fu) in enumerate(zip(local, full)) if lo != fu]
        if not diff:
            return None
        axis = diff[0]
        group = self.tp // (full[axis] // local[axis])  # ranks holding the same piece (replicated KV heads)
        return TPSlice(axis, (tp_rank // group) * local[axis], local[axis], owner=tp_rank % group == 0)

    def _gather(self, name: str, piece: Callable[[int], np.ndarray]) -> np.ndarray:
        if self.part(name, 0) is None:
            return piece(0)
        full = np.empty(self.full[name], np.float32)
        for t in range(self.tp):
            p = self.part(name, t)
            assert p is not None  # split on rank 0, so on every rank
            if p.owner:
                index = [slice(None)] * full.ndim
                index[p.axis] = slice(p.start, p.start + p.size)
                full[tuple(index)] = piece(t)
        return full

    def weights(self, name: str) -> np.ndarray:
        """The full fp32 tensor of parameter ``name``."""
        return self._gather(name, lambda t: _read(rank_file(self.path, "model", t), name))

    def step(self) -> int:
        """The optimizer's step count."""
        return int(_read(rank_file(self.path, "optim", 0), "t").reshape(-1)[0])

    def has_master(self, name: str) -> bool:
        """Whether the optimizer kept an fp32 master of ``name`` (else the parameter is its own)."""
        return (state_key("master", 0) if self.sharded else f"master.{name}") in self.optim_keys

    def optim(self, kind: str, name: str) -> np.ndarray:
        """The full fp32 optimizer tensor ``kind`` ("m", "v" or "master") of parameter ``name``."""
        if not self.sharded:
            return self._gather(name, lambda t: _read(rank_file(self.path, "optim", t), f"{kind}.{name}"))
        return self._gather(name, lambda t: self._flat(kind, t, name))

    def _flat(self, kind: str, t: int, name: str) -> np.ndarray:
        """Parameter ``name``'s local tensor of TP rank ``t`` from the DP chunks of every bucket."""
        shards = ShardLayout(tuple(math.prod(self.local[t][n]) for n in self.names), self.dp, self.bucket_bytes)
        i = self.names.index(name)
        lo, hi = shards.offsets[i], shards.offsets[i + 1]
        out = []
        for k, ((b_lo, b_hi), chunk) in enumerate(zip(shards.buckets, shards.chunks)):
            a, b = max(lo, b_lo), min(hi, b_hi)
            while a < b:  # the pieces of [a, b) in the chunks of DP ranks
                r = (a - b_lo) // chunk
                end = min(b, b_lo + (r + 1) * chunk)
                f = rank_file(self.path, "optim", r * self.tp + t)
                out.append(_read(f, state_key(kind, k), (slice(a - b_lo - r * chunk, end - b_lo - r * chunk),)))
                a = end
        return np.concatenate(out).reshape(self.local[t][name])


def local_state(saved: SavedState, params: list[tuple[str, TPSlice | None, bool]], dp: int, dp_rank: int,
                shard: bool) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(weights, optimizer state) of one rank of another layout.

    ``params``: (name, this rank's slice, fp32?) in model order. The optimizer state has the format
    of ``optim.AdamW`` or, when ``shard``, of ``optim.ShardedAdamW`` (this DP
    rank's chunk of every bucket); a master copy is kept for non-fp32 parameters.
    """
    weights = {n: cut(saved.weights(n), part) for n, part, _ in params}

    def master(name: str) -> np.ndarray:
        return saved.optim("master", name) if saved.has_master(name) else saved.weights(name)

    kinds: dict[str, Callable[[str], np.ndarray]] = {"m": lambda n: saved.optim("m", n),
                                                     "v": lambda n: saved.optim("v", n), "master": master}
    state: dict[str, np.ndarray] = {"t": np.array(saved.step(), np.int64)}
    keep_master = [n for n, _, fp32 in params if not fp32]
    if not (shard and dp > 1):
        for n, part, fp32 in params:
            for kind in ("m", "v") + (() if fp32 else ("master",)):
                state[f"{kind}.{n}"] = cut(kinds[kind](n), part)
        return weights, state
    shards = ShardLayout(tuple(weights[n].size for n, _, _ in params), dp, saved.bucket_bytes)
    offsets = shards.offsets
    state[LAYOUT_KEY] = np.array(shards.meta(dp_rank), np.int64)
    for kind in ("m", "v") + (("master",) if keep_master else ()):
        chunks = [np.zeros(chunk, np.float32) for chunk in shards.chunks]
        for i, (n, part, _) in enumerate(params):
            local = None
            for k in range(len(chunks)):
                lo, hi = shards.owned(k, dp_rank)
                a, b = max(lo, offsets[i]), min(hi, offsets[i + 1])
                if a < b:
                    if local is None:
                        local = cut(kinds[kind](n), part).reshape(-1)
                    chunks[k][a - lo:b - lo] = local[a - offsets[i]:b - offsets[i]]
        state.update({state_key(kind, k): c for k, c in enumerate(chunks)})
    return weights, state
