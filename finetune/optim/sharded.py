"""Sharded AdamW (ZeRO-1 style): each DP rank keeps fp32 master weights and Adam moments for 1/dp.

As in ``AdamW``, fp32 parameters are their own master: when every parameter is fp32 no
master shard is stored (the chunk is read from the parameters, identical on all DP ranks), so the
state is exactly the moments' 8 bytes per element / dp; bf16/fp16 parameters add a 4-byte master.

Partition and state keys: ``jobspec/shard_layout.py`` (``ShardLayout``, which resharding reads by too): the
parameters end to end in one flat index space, cut into buckets of about 25 MB of fp32, each split into
``dp`` equal chunks; DP rank ``r`` owns chunk ``r`` of every bucket (a huge embedding is split too).

One step: per bucket, flatten the local gradients in fp32, reduce-scatter (SUM, see ``grads.py``) over
the DP group to get this rank's chunk, unscale, take the global norm over all chunks (and TP
slices), skip on a non-finite norm, clip, AdamW-update the chunk, then all-gather the updated
chunks and write them back into the parameters. The math per element is that of
``AdamW`` (``optim/adamw.py``; torch AdamW: decoupled decay, bias corrections, no decay on 1-D params),
with the same kernel (``optim/update.py`` ``adamw_update``, returning new tensors). The collectives are
the DP transport's (``finetune/transport.py``), logged once.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import mindspore as ms
import numpy as np
from mindspore import ops

from finetune.collectives import all_reduce_sum
from finetune.dist import RankInfo
from finetune.hostmem import snapshot
from finetune.optim.update import BiasCorrection, StepGate, write_param
from finetune.parallel.grads import NormPiece, finish_norm, norm_partials, norm_weights
from finetune.parallel.overlap import fp32, reduce_now
from finetune.transport import Flight
from jobspec.config import TrainConfig
from jobspec.memory import BUCKET_BYTES
from jobspec.shard_layout import LAYOUT_KEY, ShardLayout, state_key

if TYPE_CHECKING:
    from finetune.parallel.zero3 import ShardedWeights


class ShardedAdamW:
    """AdamW whose fp32 state is partitioned over the DP group; same interface as ``optim.AdamW``
    (``optim.Optimizer``)."""

    sharded = True

    def __init__(self, params: list, cfg: TrainConfig, rank: RankInfo, bucket_bytes: int = BUCKET_BYTES):
        self.params, self.cfg, self.rank = list(params), cfg, rank
        dp, r = rank.dp, rank.dp_rank
        self.layout = ShardLayout(tuple(int(np.prod(p.shape)) for p in self.params), dp, bucket_bytes)
        self.sizes, self.offsets, self.buckets = self.layout.sizes, self.layout.offsets, self.layout.buckets
        self.chunk = self.layout.chunks
        self.bucket_params = [[i for i, _, _ in found] for found in self.layout.bucket_pieces]
        self.mine = [self.layout.pieces(*self.layout.owned(k, r)) for k in range(len(self.buckets))]
        self.targets = [[(self.params[i], a, b, self.offsets[i] + a - lo) for i, a, b in found]  # _write_back's
                        for (lo, _), found in zip(self.buckets, self.layout.bucket_pieces)]
        self.weights: ShardedWeights | None = None  # ZeRO-3's weight chunks (finetune/parallel/zero3.py)
        self.keep_master = any(p.dtype != ms.float32 for p in self.params)
        self.master = [self.own_chunk(k) for k in range(len(self.buckets))] if self.keep_master else []
        self.m = [ops.zeros((c,), dtype=ms.float32) for c in self.chunk]
        self.v = [ops.zeros((c,), dtype=ms.float32) for c in self.chunk]
        self.segs = [self._segments(k) for k in range(len(self.buckets))]
        self.norm_pieces: list[NormPiece] = [(k, slice(a, b), ws, wr) for k, segs in enumerate(self.segs)
                                             for a, b, _, ws, wr in segs]  # what the norm reads, fixed
        self.corrections = BiasCorrection(cfg)  # and the applied-step count
        self.gate = StepGate(rank)
        self.channel = rank.dp_comm.channel([c * dp for c in self.chunk], self.params)  # the DP transport's
        rank.log(f"[train] sharded optimizer over dp={dp}: {len(self.buckets)} bucket(s); {self.channel.describe()}")

    # ---------------------------------------------------------------- layout helpers
    def own_chunk(self, k: int) -> ms.Tensor:
        """This rank's chunk of bucket ``k`` of the parameters in fp32, zero-padded to the chunk size (ZeRO-3: the
        weight chunk it keeps)."""
        if self.weights is not None and k in self.weights.chunks:
            return fp32(self.weights.chunks[k])
        parts = [self.params[i].reshape(-1)[a:b].astype(ms.float32) for i, a, b in self.mine[k]]
        return self._pad(parts, self.chunk[k], ms.float32)

    @staticmethod
    def _pad(parts: list, length: int, dtype) -> ms.Tensor:
        have = sum(int(p.shape[0]) for p in parts)
        if have < length:
            parts = parts + [ops.zeros((length - have,), dtype=dtype)]
        return ops.cat(parts) if len(parts) > 1 else parts[0]

    def _segments(self, k: int) -> list[tuple[int, int, bool, float, float]]:
        """Runs of this rank's chunk ``k`` with equal (decay?, split weight, replicated weight).

        Ranges instead of per-element masks keep the extra memory at a few numbers per bucket.
        """
        out: list[tuple[int, int, bool, float, float]] = []
        pos = 0
        for i, a, b in self.mine[k]:
            p = self.params[i]
            attrs = (len(p.shape) > 1, *norm_weights(p))  # no decay on 1-D params; see grads.norm_weights
            if out and out[-1][2:] == attrs and out[-1][1] == pos:
                out[-1] = (out[-1][0], pos + b - a, *attrs)
            else:
                out.append((pos, pos + b - a, *attrs))
            pos += b - a
        return out

    def launch(self, k: int, grads) -> Flight:
        """Start reducing bucket ``k`` of ``grads`` over DP (see overlap.GradReduction); ``wait()``
        gives this rank's chunk of the sum, fp32. An fp32 gradient filling a bucket alone may be
        overwritten with the sum."""
        parts = [(grads[i], a, b) for i, a, b in self.layout.bucket_pieces[k]]
        return self.channel.reduce_scatter(k, parts)

    def reduce(self, grads: tuple | list) -> list[ms.Tensor]:
        """This rank's chunk of every bucket of the gradients summed over DP, in fp32, after the backward."""
        return reduce_now(self, grads)

    # ---------------------------------------------------------------- step
    def step(self, grads: tuple | list, lr: float, grad_scale: ms.Tensor | None = None) -> tuple[ms.Tensor, ms.Tensor]:
        """``apply`` of the DP-reduced ``grads``."""
        return self.apply(self.reduce(grads), lr, grad_scale)

    def apply(self, shards: list, lr: float, grad_scale: ms.Tensor | None = None) -> tuple[ms.Tensor, ms.Tensor]:
        """Unscale, clip and apply this rank's chunks of the DP-reduced gradients (``reduce`` or
        GradReduction.finish), all-gather the new weights; returns (global grad_norm, applied) as
        device scalars (a step whose norm is not finite changes nothing, see optim.BiasCorrection)."""
        clip = self.gate.clip(self._global_norm(shards), self.cfg.clip_grad, grad_scale)
        # optim.adamw_update with torch's bias correction folded in (optim.BiasCorrection);
        # a chunk mixing decaying and non-decaying ranges gets p *= 1 - lr*wd on its decaying ranges first.
        ks = self.corrections.step(lr, clip.ok)
        if clip.skip:  # skipped on the host: nothing to run
            return clip.norm, clip.ok
        no_wd = ms.Tensor(0.0, ms.float32)
        wd_t = ks.decay_factor * self.cfg.weight_decay  # chunks that decay throughout
        keep = 1.0 - lr * self.cfg.weight_decay
        keep_t = ops.where(clip.ok, ms.Tensor(keep, ms.float32), 1.0)  # a skipped step decays nothing
        for k, g in enumerate(shards):
            w = self.master[k] if self.keep_master else self.own_chunk(k)
            decays = {decay for _, _, decay, _, _ in self.segs[k]}
            wd = wd_t if decays == {True} else no_wd
            if len(decays) > 1 and keep != 1.0:  # mixed chunk: decay its ranges first
                w = self._decayed(w, k, keep_t)
            w, self.m[k], self.v[k] = self.gate.update(w, self.m[k], self.v[k], ks, wd, g, clip)
            if self.keep_master:
                self.master[k] = w
            self._write_back(k, w)
        return clip.norm, clip.ok

    def _decayed(self, w: ms.Tensor, k: int, keep: ms.Tensor) -> ms.Tensor:
        """A new chunk ``w`` with the decaying ranges scaled by ``keep`` (padding stays zero)."""
        parts = [w[a:b] * keep if decay else w[a:b] for a, b, decay, _, _ in self.segs[k]]
        end = sum(b - a for a, b, *_ in self.segs[k])
        if end < self.chunk[k]:
            parts.append(w[end:])
        return ops.cat(parts) if len(parts) > 1 else parts[0]

    def _global_norm(self, shards: list) -> ms.Tensor:
        split, rep = norm_partials(shards, self.norm_pieces, self.gate.on_host)
        both = all_reduce_sum(ops.stack([split, rep]), self.rank.dp_group)
        return finish_norm(both[0], both[1], self.rank)

    def _write_back(self, k: int, chunk: ms.Tensor) -> None:
        """All-gather bucket ``k``'s updated chunks into the parameters (each written once whole); ZeRO-3 keeps
        the chunk instead (``ShardedWeights.write``)."""
        if self.weights is not None:
            self.weights.write(k, chunk)
            return
        self.channel.gather_into(k, chunk.astype(self.targets[k][0][0].dtype), self.targets[k], write_param)

    def masters(self) -> list[ms.Tensor]:
        """This rank's fp32 chunks the kernel updates (for optim.UpdateCheck)."""
        return self.master if self.keep_master else [self.own_chunk(k) for k in range(len(self.buckets))]

    # ---------------------------------------------------------------- state
    def _meta(self) -> np.ndarray:
        return np.array(self.layout.meta(self.rank.dp_rank), np.int64)

    def state_dict(self) -> dict[str, np.ndarray]:
        """Only this DP rank's shard: ``shard.{master,m,v}.<bucket>`` plus the step and layout."""
        out: dict[str, np.ndarray] = {"t": self.corrections.count(), LAYOUT_KEY: self._meta()}
        for k in range(len(self.buckets)):
            if self.keep_master:
                out[state_key("master", k)] = snapshot(self.master[k])
            out[state_key("m", k)] = snapshot(self.m[k])
            out[state_key("v", k)] = snapshot(self.v[k])
        return out

    def load_state_dict(self, d: dict[str, np.ndarray]) -> None:
        """Restore a shard saved by the same DP rank of the same layout (ValueError otherwise)."""
        if LAYOUT_KEY not in d or not np.array_equal(np.asarray(d[LAYOUT_KEY]), self._meta()):
            got = d.get(LAYOUT_KEY)
            raise ValueError(f"optimizer shard layout {None if got is None else list(got)} does not match this "
                             f"run's [dp, dp_rank, params, buckets]={list(self._meta())}; resume with the same "
                             "parallel.tp/parallel.dp as the checkpoint, or train.resume=never")
        self.corrections.restore(d["t"])
        if self.keep_master:
            self.master = [ms.Tensor(d[state_key("master", k)], ms.float32) for k in range(len(self.buckets))]
        self.m = [ms.Tensor(d[state_key("m", k)], ms.float32) for k in range(len(self.buckets))]
        self.v = [ms.Tensor(d[state_key("v", k)], ms.float32) for k in range(len(self.buckets))]
