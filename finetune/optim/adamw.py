"""AdamW with fp32 master weights, and the one interface (``Optimizer``) of the optimizer family.

The optimizer owns everything between "gradients of the scaled loss" and "updated parameters":
reduce over data-parallel ranks (``reduce``, or the buckets ``GradReduction`` started during the
backward), unscale, global-norm clip, skip on overflow, update, write back (``optim/update.py``).
"""
from __future__ import annotations

from typing import Protocol

import mindspore as ms
import numpy as np
from mindspore import ops

from finetune.collectives import Ready
from finetune.dist import RankInfo
from finetune.hostmem import snapshot
from finetune.optim.update import BiasCorrection, StepGate, write_param
from finetune.parallel.grads import BucketSum, buckets_by_bytes, global_grad_norm, sum_bucket_over_dp
from finetune.parallel.overlap import Bucketed, reduce_now
from jobspec.config import TrainConfig
from jobspec.memory import BUCKET_BYTES


class Optimizer(Bucketed, Protocol):
    """What the trainer, the gradient reduction (``Bucketed``) and the checkpoint use of an optimizer:
    ``AdamW`` or ``ShardedAdamW`` (``optim/sharded.py``)."""

    sharded: bool  # the state is split over the DP ranks (each rank saves its own shard)
    corrections: BiasCorrection  # the applied-step count and torch's bias corrections

    def apply(self, reduced: list, lr: float, grad_scale: ms.Tensor | None = None) -> tuple[ms.Tensor, ms.Tensor]:
        """Apply the DP-reduced gradients; (grad norm, applied) as device scalars."""

    def step(self, grads: tuple | list, lr: float, grad_scale: ms.Tensor | None = None) -> tuple[ms.Tensor, ms.Tensor]:
        """Reduce, then apply."""

    def masters(self) -> list[ms.Tensor]:
        """The fp32 weights the kernel updates (this rank's)."""

    def state_dict(self) -> dict[str, np.ndarray]:
        """The state to checkpoint (this rank's part when sharded)."""

    def load_state_dict(self, d: dict[str, np.ndarray]) -> None:
        """Restore ``state_dict``'s output."""


class AdamW:
    """torch.optim.AdamW semantics (decoupled weight decay), gradients clipped by global norm.

    Parameters that are not fp32 (bf16 on Ascend) get an fp32 master copy; fp32 parameters are
    their own master. Norm and bias parameters (1-D) get no weight decay.
    """

    sharded = False

    def __init__(self, params: list, cfg: TrainConfig, rank: RankInfo, bucket_bytes: int = BUCKET_BYTES):
        self.params, self.cfg, self.rank = list(params), cfg, rank
        self.master = [p if p.dtype == ms.float32 else p.astype(ms.float32) for p in self.params]
        self.m = [ops.zeros(p.shape, dtype=ms.float32) for p in self.params]  # replaced each step (StepGate.update)
        self.v = [ops.zeros(p.shape, dtype=ms.float32) for p in self.params]
        self.decay = [cfg.weight_decay if len(p.shape) > 1 else 0.0 for p in self.params]
        sizes = [int(np.prod(p.shape)) for p in self.params]
        self.bucket_params = buckets_by_bytes(sizes, 4, bucket_bytes)
        self.channel = rank.dp_comm.channel([sum(sizes[i] for i in b) for b in self.bucket_params]
                                            ) if rank.dp > 1 else None
        self.corrections = BiasCorrection(cfg)  # and the applied-step count
        self.gate = StepGate(rank)

    def launch(self, k: int, grads) -> BucketSum | Ready:
        """Start the DP sum of bucket ``k`` of ``grads`` (see overlap.GradReduction); ``wait()`` gives
        its gradients in fp32."""
        return sum_bucket_over_dp([grads[i] for i in self.bucket_params[k]], self.rank, self.channel, k)

    def reduce(self, grads: tuple | list) -> list:
        """Every bucket of ``grads`` summed over DP, after the backward (no overlap)."""
        return reduce_now(self, grads)

    def step(self, grads: tuple | list, lr: float, grad_scale: ms.Tensor | None = None) -> tuple[ms.Tensor, ms.Tensor]:
        """``apply`` of the DP-reduced ``grads``."""
        return self.apply(self.reduce(grads), lr, grad_scale)

    def apply(self, buckets: list, lr: float, grad_scale: ms.Tensor | None = None) -> tuple[ms.Tensor, ms.Tensor]:
        """Unscale, clip and apply the DP-reduced gradients (``reduce`` or GradReduction.finish);
        returns (grad_norm, applied) as device scalars, read by no one here: a step whose norm is
        not finite changes nothing (see BiasCorrection)."""
        grads = [g for bucket in buckets for g in bucket]
        clip = self.gate.clip(global_grad_norm(grads, self.params, self.rank, self.gate.on_host), self.cfg.clip_grad,
                              grad_scale)
        k = self.corrections.step(lr, clip.ok)
        if clip.skip:  # skipped on the host: nothing to run
            return clip.norm, clip.ok
        wd_t = {d: k.decay_factor * d for d in set(self.decay)}  # one per distinct decay
        for i, (p, g) in enumerate(zip(self.params, grads)):
            w, self.m[i], self.v[i] = self.gate.update(self.master[i], self.m[i], self.v[i], k, wd_t[self.decay[i]],
                                                       g, clip)
            if self.master[i] is not p:
                self.master[i] = w
            write_param(p, w)
        return clip.norm, clip.ok

    def masters(self) -> list[ms.Tensor]:
        """The fp32 weights the kernel updates (for UpdateCheck)."""
        return self.master

    def state_dict(self) -> dict[str, np.ndarray]:
        """Moments (and masters when separate), keyed by parameter name."""
        out: dict[str, np.ndarray] = {"t": self.corrections.count()}
        for p, w, m, v in zip(self.params, self.master, self.m, self.v):
            out[f"m.{p.name}"] = snapshot(m)
            out[f"v.{p.name}"] = snapshot(v)
            if w is not p:
                out[f"master.{p.name}"] = snapshot(w)
        return out

    def load_state_dict(self, d: dict[str, np.ndarray]) -> None:
        self.corrections.restore(d["t"])
        for i, p in enumerate(self.params):
            self.m[i] = ms.Tensor(d[f"m.{p.name}"], ms.float32)
            self.v[i] = ms.Tensor(d[f"v.{p.name}"], ms.float32)
            if self.master[i] is not p:
                self.master[i] = ms.Tensor(d[f"master.{p.name}"], ms.float32)
