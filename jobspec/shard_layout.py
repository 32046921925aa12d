"""The ZeRO partition and its optimizer-state keys, in one place (issue 32 item 6).

The sharded optimizer (``finetune/optim/sharded.py``) cuts its state by it and resharding
(``finetune/io/reshard.py``) reads and writes checkpoints by it: if one side changed alone, resume would break
silently. Pure Python (no MindSpore, no numpy).

Partition: the trained parameters, in model order, end to end in one flat fp32 index space, cut into
buckets of ``bucket_bytes``; every bucket is split into ``dp`` equal contiguous chunks (the last padded with
zeros) and DP rank ``r`` owns chunk ``r`` of every bucket, so each rank holds 1/dp of the state up to padding
whatever the parameter sizes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

Piece = tuple[int, int, int]  # (parameter index, start, end) in that parameter's flat view
LAYOUT_KEY = "shard.layout"  # the state's [dp, dp_rank, elements, buckets]


def state_key(kind: str, k: int) -> str:
    """The optimizer-state key of bucket ``k``'s chunk of ``kind`` (m, v, master)."""
    return f"shard.{kind}.{k}"


@dataclass(frozen=True)
class ShardLayout:
    """The partition of parameters of ``sizes`` elements over ``dp`` ranks in buckets of ``bucket_bytes``."""

    sizes: tuple[int, ...]
    dp: int
    bucket_bytes: int
    offsets: tuple[int, ...] = field(init=False)  # each parameter's start in the flat space, and the total
    buckets: tuple[tuple[int, int], ...] = field(init=False)  # flat [lo, hi) of each bucket
    chunks: tuple[int, ...] = field(init=False)  # elements per DP rank of each bucket
    bucket_pieces: tuple[tuple[Piece, ...], ...] = field(init=False)  # the parameter slices each bucket covers

    def __post_init__(self) -> None:
        offsets = [0]
        for n in self.sizes:
            offsets.append(offsets[-1] + n)
        total, per = offsets[-1], max(1, self.bucket_bytes // 4)
        buckets = tuple((a, min(a + per, total)) for a in range(0, total, per))
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "buckets", buckets)
        object.__setattr__(self, "chunks", tuple(math.ceil((hi - lo) / self.dp) for lo, hi in buckets))
        object.__setattr__(self, "bucket_pieces", tuple(tuple(self.pieces(lo, hi)) for lo, hi in buckets))

    @property
    def total(self) -> int:
        return self.offsets[-1]

    def pieces(self, lo: int, hi: int) -> list[Piece]:
        """The parameter slices covering the flat range [lo, hi)."""
        out = []
        for i, n in enumerate(self.sizes):
            a, b = max(lo, self.offsets[i]), min(hi, self.offsets[i] + n)
            if a < b:
                out.append((i, a - self.offsets[i], b - self.offsets[i]))
        return out

    def owned(self, k: int, r: int) -> tuple[int, int]:
        """DP rank ``r``'s flat range of bucket ``k`` (without the padding)."""
        lo, hi = self.buckets[k]
        c = self.chunks[k]
        return min(lo + r * c, hi), min(lo + (r + 1) * c, hi)

    def meta(self, r: int) -> list[int]:
        """What ``LAYOUT_KEY`` records for DP rank ``r``."""
        return [self.dp, r, self.total, len(self.buckets)]
