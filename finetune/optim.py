"""AdamW with fp32 master weights, the learning-rate schedule and dynamic loss scaling.

The optimizer owns everything between "gradients of the scaled loss" and "updated parameters":
reduce over data-parallel ranks (``reduce``, or the buckets ``GradReduction`` started during the
backward), unscale, global-norm clip, skip on overflow, update, write back. On Ascend all of it on
the device (the step reads nothing on the host: the norm, whether the step was applied and the
loss scale are device scalars, read at the training loop's sync points); on CPU the skip and clip
decisions read the norm (``StepGate``).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Protocol, cast

import mindspore as ms
import numpy as np
from mindspore import ops

from finetune.dist import BUCKET_BYTES, RankInfo, Ready
from finetune.parallel.grads import BucketSum, buckets_by_bytes, global_grad_norm, sum_bucket_over_dp
from finetune.parallel.overlap import Bucketed, reduce_now
from jobspec.config import LossScaleConfig, TrainConfig


def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then cosine or constant."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def unscale_and_clip(grads: list, norm: ms.Tensor, max_norm: float, grad_scale: ms.Tensor | None
                     ) -> tuple[list, ms.Tensor, ms.Tensor]:
    """On the device, nothing read: (the gradients unscaled, clipped to ``max_norm`` as torch clips
    (0: no clipping) and zeroed when their norm is not finite; the unscaled norm; whether it is
    finite). ``norm`` is the norm of ``grads`` as given, scaled by ``grad_scale`` when that is set."""
    if grad_scale is not None:
        norm = norm / grad_scale
    ok = ops.isfinite(norm)
    coef = ops.where(norm > max_norm, max_norm / (norm + 1e-6), 1.0) if max_norm > 0 else None
    if grad_scale is not None:
        coef = 1.0 / grad_scale if coef is None else coef / grad_scale
    return [ops.where(ok, g if coef is None else g * coef, 0.0) for g in grads], norm, ok


class KernelScalars(NamedTuple):
    """Scalars of ``adamw_update`` for one step (fp32 device scalars)."""

    lr: ms.Tensor
    beta1: ms.Tensor
    beta2: ms.Tensor
    eps: ms.Tensor
    decay_factor: ms.Tensor  # weight decay ``wd`` enters the kernel as ``wd * decay_factor``


def adamw_update(w: ms.Tensor, m: ms.Tensor, v: ms.Tensor, g: ms.Tensor, k: KernelScalars, wd: ms.Tensor
                 ) -> tuple[ms.Tensor, ms.Tensor, ms.Tensor]:
    """The optimizer kernel: one AdamW step of the fp32 ``w`` as NEW tensors (w', m', v'); writes none
    of its inputs, so the caller keeps what it returns (docs/ascend-contracts.md, "optimizer kernel").

    m' = b1 m + (1 - b1) g;  v' = b2 v + (1 - b2) g^2;  w' = w (1 - lr' wd) - lr' m' / (sqrt(v') + eps'),
    torch's AdamW step (decay first) with the bias corrections folded into lr', eps' and wd
    (BiasCorrection), from documented ops (``lerp``, ``addcmul``, ...: eight passes) that return
    their results in PyNative on every backend (not ``addcdiv``: MindSpore 2.10's CPU kernel gives NaN
    for value 0, a skipped step's lr', with a zero numerator). ``ops.AdamWeightDecay`` (one pass on CPU, about
    5x faster there) is not used: it works by writing its inputs in place, which MindSpore documents
    for no non-Parameter tensor in PyNative (on the CPU its returned tensors are zeros), and on Ascend
    it lowers to a non-aclnn kernel; ``mint.optim.AdamW``'s ``ops.auto_generate.AdamW`` is Ascend-only
    and also writes in place.
    """
    m = ops.lerp(m, g, 1.0 - k.beta1)
    v = ops.addcmul(v * k.beta2, g, g, 1.0 - k.beta2)
    return w * (1.0 - k.lr * wd) - k.lr * (m / (ops.sqrt(v) + k.eps)), m, v


class BiasCorrection:
    """The count of applied steps (a device int32) and torch AdamW's bias corrections folded into
    the kernel's arguments, looked up on the device by that count, so a skipped step needs no host read.

    The kernel computes ``w -= lr' * (m / (sqrt(v) + eps') + wd' * w)`` without bias correction.
    With lr' = lr*sqrt(bc2)/bc1, eps' = eps*sqrt(bc2), wd' = wd*bc1/sqrt(bc2) that is torch's AdamW.
    Row t of the table: (sqrt(bc2)/bc1, eps*sqrt(bc2), bc1/sqrt(bc2)) of step t, in float64 made fp32.
    A skipped step gets lr' 0 (on the device gate the kernel then leaves the weights as they were and
    ``StepGate.update`` keeps the old moments; on the host gate no kernel runs; see StepGate).
    """

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.applied = ms.Tensor(0, ms.int32)
        self.steps = 0  # steps taken or skipped: an upper bound of ``applied`` (sizes the table)
        self.table = ms.Tensor(np.zeros((0, 3), np.float32))
        self.betas = cast(tuple[ms.Tensor, ms.Tensor], tuple(ms.Tensor(b, ms.float32) for b in cfg.betas))  # a pair

    def _rows(self, n: int) -> np.ndarray:
        b1, b2 = self.cfg.betas
        t = np.maximum(np.arange(n, dtype=np.float64), 1.0)  # row 0 (nothing applied yet) repeats row 1
        bc1, bc2 = 1.0 - b1 ** t, np.sqrt(1.0 - b2 ** t)
        return np.stack([bc2 / bc1, self.cfg.eps * bc2, bc1 / bc2], axis=1).astype(np.float32)

    def step(self, lr: float, ok: ms.Tensor) -> KernelScalars:
        """Count this step when ``ok``; the kernel's arguments for it."""
        self.applied = self.applied + ok.astype(ms.int32)
        self.steps += 1
        if self.table.shape[0] <= self.steps:  # grown by doubling: a host-to-device copy, now and then
            self.table = ms.Tensor(self._rows(2 * self.steps + 2))
        row = ops.gather(self.table, self.applied, 0)
        return KernelScalars(ops.where(ok, row[0] * lr, 0.0), *self.betas, row[1], row[2])

    def count(self) -> np.ndarray:
        """The applied steps, for a checkpoint (a host read)."""
        return np.array(int(self.applied.asnumpy()), dtype=np.int64)

    def restore(self, t) -> None:
        self.steps = int(np.asarray(t).item())
        self.applied = ms.Tensor(self.steps, ms.int32)


class StepGate:
    """Where the step decides whether it is applied (its gradient norm is finite) and clips.

    On the device (Ascend): nothing is read; the gradients are unscaled, clipped and, on a
    non-finite norm, zeroed with ``ops.where``, and the kernel runs with lr' 0, its new moments
    dropped for the old ones, so the launch queue never waits for the host. On the host (CPU,
    where kernels run synchronously and a read costs nothing): the norm is read once and a
    non-finite step calls no kernel at all. Both give the same numbers (tests/finetune/test_optim.py).
    """

    def __init__(self, rank: RankInfo):
        self.on_device = rank.device_target != "CPU"

    def gradients(self, grads: list, norm: ms.Tensor, max_norm: float, grad_scale: ms.Tensor | None
                  ) -> tuple[list | None, ms.Tensor, ms.Tensor]:
        """(the gradients to apply, or None for a step skipped on the host; the unscaled norm;
        whether it is finite, a device bool)."""
        if self.on_device:
            return unscale_and_clip(grads, norm, max_norm, grad_scale)
        if grad_scale is not None:
            norm = norm / grad_scale
        ok = ops.isfinite(norm)
        value = float(norm.asnumpy())  # the step's one host read
        if not math.isfinite(value):
            return None, norm, ok
        coef = max_norm / (norm + 1e-6) if 0 < max_norm < value else None  # as unscale_and_clip computes it
        if grad_scale is not None:
            coef = 1.0 / grad_scale if coef is None else coef / grad_scale
        return (grads if coef is None else [g * coef for g in grads]), norm, ok

    def update(self, w, m, v, k: KernelScalars, wd: ms.Tensor, g: ms.Tensor, ok: ms.Tensor
               ) -> tuple[ms.Tensor, ms.Tensor, ms.Tensor]:
        """One ``adamw_update`` of ``w``: the new (w, m, v) to keep (on the device gate the old moments
        when the step is skipped; ``w`` is then unchanged: lr' 0, zeroed gradients)."""
        w_new, m_new, v_new = adamw_update(w, m, v, g, k, wd)
        if self.on_device:
            return w_new, ops.where(ok, m_new, m), ops.where(ok, v_new, v)
        return w_new, m_new, v_new


def write_param(p: ms.Parameter, value: ms.Tensor) -> None:
    """Copy ``value`` into the storage of ``p`` (``ops.assign``: the documented in-place write to a Parameter)."""
    ops.assign(p, value if value.dtype == p.dtype else value.astype(p.dtype))


class UpdateCheck:
    """The run fails loudly when the optimizer changes no weight (issue 18: a kernel whose results do
    not reach the weights gives a flat loss for hours). Built before the first step, it keeps on the
    host the first ``SAMPLE`` values of every fp32 master and the applied-step count; ``verify`` (at a
    sync point, until it passed once) compares them again once this run applied a step (with
    ``train.lr`` 0 nothing is meant to change and nothing is checked)."""

    SAMPLE = 64

    def __init__(self, opt: Optimizer, lr: float):
        self.opt = opt
        self.before: np.ndarray | None
        self.before, self.applied = self._read() if lr > 0 else (None, 0)

    def _read(self) -> tuple[np.ndarray, int]:
        """(the sampled master values, the applied-step count) in one host read."""
        parts = [w.reshape(-1)[:self.SAMPLE].astype(ms.float32) for w in self.opt.masters()]
        values = ops.cat(parts + [self.opt.corrections.applied.astype(ms.float32).reshape(1)]).asnumpy()
        return values[:-1], int(values[-1])

    def verify(self, step: int) -> None:
        """RuntimeError when this run applied steps and no sampled master value changed."""
        if self.before is None:
            return
        now, applied = self._read()
        if applied == self.applied:
            return
        if np.array_equal(now, self.before):
            raise RuntimeError(
                f"the optimizer applied {applied - self.applied} step(s) up to step {step} but no master "
                "weight changed: the AdamW update does not reach the weights on this device and software "
                "stack, so the loss would stay flat. Stopped before wasting the run; check the MindSpore/CANN "
                "versions against README.md and run the self-test (make selftest) on this host")
        self.before = None


class LossScaler:
    """Dynamic loss scale for fp16, on the device: x growth after ``growth_interval`` good steps,
    x backoff (not below 1) on a skipped step. Off (scale 1) for fp32 and bf16."""

    def __init__(self, cfg: LossScaleConfig, enabled: bool):
        self.cfg, self.enabled = cfg, enabled
        self.scale = ms.Tensor(cfg.initial if enabled else 1.0, ms.float32)
        self.good_steps = ms.Tensor(0.0, ms.float32)

    @property
    def grad_scale(self) -> ms.Tensor | None:
        """What the optimizer divides the gradients by (None when off)."""
        return self.scale if self.enabled else None

    def loss_factor(self, label_tokens: int) -> ms.Tensor:
        """scale / label tokens: the factor of every micro-batch's summed token loss."""
        return self.scale / label_tokens if self.enabled else ms.Tensor(1.0 / label_tokens, ms.float32)

    def update(self, ok: ms.Tensor) -> None:
        if not self.enabled:
            return
        good = ops.where(ok, self.good_steps + 1.0, 0.0)
        grow = good >= self.cfg.growth_interval
        self.scale = ops.where(ok, ops.where(grow, self.scale * self.cfg.growth_factor, self.scale),
                               ops.maximum(self.scale * self.cfg.backoff_factor, 1.0))
        self.good_steps = ops.where(grow, 0.0, good)

    def state_dict(self) -> dict:
        return {"scale": float(self.scale.asnumpy()), "good_steps": int(self.good_steps.asnumpy())}

    def load_state_dict(self, d: dict) -> None:
        self.scale = ms.Tensor(float(d["scale"]), ms.float32)
        self.good_steps = ms.Tensor(float(d["good_steps"]), ms.float32)


class SkippedSteps:
    """Steps skipped for non-finite gradients, counted on the device and read at sync points:
    ``counts`` = (skipped since the last read, the current run of consecutive skips, the longest
    run since the last read)."""

    def __init__(self) -> None:
        self.counts = ops.zeros((3,), ms.float32)

    def update(self, ok: ms.Tensor) -> None:
        bad = 1.0 - ok.astype(ms.float32)
        run = (self.counts[1] + 1.0) * bad
        self.counts = ops.stack([self.counts[0] + bad, run, ops.maximum(self.counts[2], run)])

    def read(self) -> None:
        """The counts were read: the ones "since the last read" start again."""
        self.counts = self.counts * ms.Tensor(np.array([0.0, 1.0, 0.0], np.float32))


class Optimizer(Bucketed, Protocol):
    """What the trainer, the gradient reduction (``Bucketed``) and the checkpoint use of an optimizer:
    ``AdamW`` or ``parallel.zero.ShardedAdamW``."""

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
        self.m = [ops.zeros(p.shape, ms.float32) for p in self.params]  # replaced each step (StepGate.update)
        self.v = [ops.zeros(p.shape, ms.float32) for p in self.params]
        self.decay = [cfg.weight_decay if len(p.shape) > 1 else 0.0 for p in self.params]
        self.bucket_params = buckets_by_bytes([int(np.prod(p.shape)) for p in self.params], 4, bucket_bytes)
        self.corrections = BiasCorrection(cfg)  # and the applied-step count
        self.gate = StepGate(rank)

    def launch(self, k: int, grads) -> BucketSum | Ready:
        """Start the DP sum of bucket ``k`` of ``grads`` (see overlap.GradReduction); ``wait()`` gives
        its gradients in fp32."""
        return sum_bucket_over_dp([grads[i] for i in self.bucket_params[k]], self.rank)

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
        grads: list | None  # None: a step skipped on the host
        grads = [g for bucket in buckets for g in bucket]
        norm = global_grad_norm(grads, self.params, self.rank)
        grads, norm, ok = self.gate.gradients(grads, norm, self.cfg.clip_grad, grad_scale)
        k = self.corrections.step(lr, ok)
        if grads is None:  # skipped on the host: nothing to run
            return norm, ok
        wd_t = {d: k.decay_factor * d for d in set(self.decay)}  # one per distinct decay
        for i, (p, g) in enumerate(zip(self.params, grads)):
            w, self.m[i], self.v[i] = self.gate.update(self.master[i], self.m[i], self.v[i], k, wd_t[self.decay[i]],
                                                       g, ok)
            if self.master[i] is not p:
                self.master[i] = w
            write_param(p, w)
        return norm, ok

    def masters(self) -> list[ms.Tensor]:
        """The fp32 weights the kernel updates (for UpdateCheck)."""
        return self.master

    def state_dict(self) -> dict[str, np.ndarray]:
        """Moments (and masters when separate), keyed by parameter name."""
        out: dict[str, np.ndarray] = {"t": self.corrections.count()}
        for p, w, m, v in zip(self.params, self.master, self.m, self.v):
            out[f"m.{p.name}"] = m.asnumpy()
            out[f"v.{p.name}"] = v.asnumpy()
            if w is not p:
                out[f"master.{p.name}"] = w.asnumpy()
        return out

    def load_state_dict(self, d: dict[str, np.ndarray]) -> None:
        self.corrections.restore(d["t"])
        for i, p in enumerate(self.params):
            self.m[i] = ms.Tensor(d[f"m.{p.name}"], ms.float32)
            self.v[i] = ms.Tensor(d[f"v.{p.name}"], ms.float32)
            if self.master[i] is not p:
                self.master[i] = ms.Tensor(d[f"master.{p.name}"], ms.float32)

