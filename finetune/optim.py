"""AdamW with fp32 master weights, the learning-rate schedule and dynamic loss scaling.

The optimizer owns everything between "gradients of the scaled loss" and "updated parameters":
reduce over data-parallel ranks, unscale, global-norm clip, skip on overflow, update, write back.
"""
from __future__ import annotations

import math
import time
from typing import NamedTuple

import mindspore as ms
import numpy as np
from mindspore import ops

from finetune.config import LossScaleConfig, TrainConfig
from finetune.dist import RankInfo
from finetune.parallel.grads import global_grad_norm, sum_grads_over_dp


def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then cosine or constant."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def clip_by_norm(grads: list, norm: float, max_norm: float) -> list:
    """Scale ``grads`` so their global norm is at most ``max_norm`` (0: no clipping), as torch does."""
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        return [g * coef for g in grads]
    return grads


class KernelScalars(NamedTuple):
    """Arguments of the in-place ``AdamWeightDecay`` kernel for one step (fp32 tensors)."""

    lr: ms.Tensor
    beta1: ms.Tensor
    beta2: ms.Tensor
    eps: ms.Tensor
    decay_factor: float  # weight decay ``wd`` enters the kernel as ``wd * decay_factor``


def kernel_scalars(cfg: TrainConfig, lr: float, t: int) -> KernelScalars:
    """Torch AdamW's bias corrections folded into the kernel's arguments for step ``t`` (1-based).

    The kernel computes ``w -= lr' * (m / (sqrt(v) + eps') + wd' * w)`` without bias correction.
    With lr' = lr*sqrt(bc2)/bc1, eps' = eps*sqrt(bc2), wd' = wd*bc1/sqrt(bc2) that is torch's AdamW.
    """
    b1, b2 = cfg.betas
    bc1, bc2 = 1.0 - b1 ** t, math.sqrt(1.0 - b2 ** t)
    f32 = lambda x: ms.Tensor(x, ms.float32)  # noqa: E731
    return KernelScalars(f32(lr * bc2 / bc1), f32(b1), f32(b2), f32(cfg.eps * bc2), bc1 / bc2)


class LossScaler:
    """Dynamic loss scale for fp16: x growth after `growth_interval` good steps, x backoff and skip on overflow."""

    def __init__(self, cfg: LossScaleConfig, enabled: bool):
        self.cfg, self.enabled = cfg, enabled
        self.scale = cfg.initial if enabled else 1.0
        self.good_steps = 0

    def update(self, ok: bool) -> None:
        if not self.enabled:
            return
        if not ok:
            self.scale = max(1.0, self.scale * self.cfg.backoff_factor)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.cfg.growth_interval:
            self.scale *= self.cfg.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, d: dict) -> None:
        self.scale, self.good_steps = float(d["scale"]), int(d["good_steps"])


class CommClock:
    """``comm_s``: host seconds an optimizer spent reducing gradients over DP (on Ascend: launch time)."""

    comm_s = 0.0

    def take_comm_s(self) -> float:
        """The seconds since the last call."""
        spent, self.comm_s = self.comm_s, 0.0
        return spent


class AdamW(CommClock):
    """torch.optim.AdamW semantics (decoupled weight decay), gradients clipped by global norm.

    Parameters that are not fp32 (bf16 on Ascend) get an fp32 master copy; fp32 parameters are
    their own master. Norm and bias parameters (1-D) get no weight decay.
    """

    def __init__(self, params: list, cfg: TrainConfig, rank: RankInfo):
        self.params, self.cfg, self.rank = list(params), cfg, rank
        self.master = [p if p.dtype == ms.float32 else ms.Parameter(p.astype(ms.float32), name="master." + p.name)
                       for p in self.params]
        self.m = [self._zeros(p, "m") for p in self.params]
        self.v = [self._zeros(p, "v") for p in self.params]
        self.decay = [cfg.weight_decay if len(p.shape) > 1 else 0.0 for p in self.params]
        self.t = 0
        self._update = ops.AdamWeightDecay()  # in place; ~7x faster than composed ops on CPU

    @staticmethod
    def _zeros(p, kind: str) -> ms.Parameter:
        return ms.Parameter(ops.zeros(p.shape, ms.float32), name=f"{kind}.{p.name}", requires_grad=False)

    def step(self, grads: tuple, lr: float, grad_scale: float = 1.0) -> tuple[float, bool]:
        """Reduce, unscale, clip and apply ``grads``; returns (grad_norm, applied)."""
        t0 = time.perf_counter()
        grads = sum_grads_over_dp(grads, self.rank)  # fp32
        self.comm_s += time.perf_counter() - t0
        if grad_scale != 1.0:
            grads = [g / grad_scale for g in grads]
        norm = global_grad_norm(grads, self.params, self.rank)
        if not math.isfinite(norm):
            return norm, False
        grads = clip_by_norm(grads, norm, self.cfg.clip_grad)
        self.t += 1
        k = kernel_scalars(self.cfg, lr, self.t)
        wd_t = {d: ms.Tensor(d * k.decay_factor, ms.float32) for d in set(self.decay)}  # one per distinct decay
        for i, (p, w, g) in enumerate(zip(self.params, self.master, grads)):
            self._update(w, self.m[i], self.v[i], k.lr, k.beta1, k.beta2, k.eps, wd_t[self.decay[i]], g)
            if w is not p:
                p.set_data(w.astype(p.dtype))
        return norm, True

    def state_dict(self) -> dict[str, np.ndarray]:
        """Moments (and masters when separate), keyed by parameter name."""
        out: dict[str, np.ndarray] = {"t": np.array(self.t, dtype=np.int64)}
        for p, w, m, v in zip(self.params, self.master, self.m, self.v):
            out[f"m.{p.name}"] = m.asnumpy()
            out[f"v.{p.name}"] = v.asnumpy()
            if w is not p:
                out[f"master.{p.name}"] = w.asnumpy()
        return out

    def load_state_dict(self, d: dict[str, np.ndarray]) -> None:
        self.t = int(np.asarray(d["t"]).item())
        for i, p in enumerate(self.params):
            self.m[i].set_data(ms.Tensor(d[f"m.{p.name}"], ms.float32))
            self.v[i].set_data(ms.Tensor(d[f"v.{p.name}"], ms.float32))
            if self.master[i] is not p:
                self.master[i].set_data(ms.Tensor(d[f"master.{p.name}"], ms.float32))

