"""The pieces AdamW and ShardedAdamW share: the learning-rate schedule, the update kernel, torch's
bias corrections, and the step gate (unscale, global-norm clip, skip on a non-finite norm).

On Ascend all of it on the device (the step reads nothing on the host: the norm and whether the
step was applied are device scalars, read at the training loop's sync points); on CPU the skip and
clip decisions read the norm (``StepGate``).
"""
from __future__ import annotations

import math
from typing import NamedTuple, cast

import mindspore as ms
import numpy as np
from mindspore import ops

from finetune.dist import RankInfo
from finetune.hostmem import own_memory
from finetune.optim.host import adamw_update_host
from jobspec.config import TrainConfig
from jobspec.platform import in_host_memory


def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then cosine or constant."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


class Clip(NamedTuple):
    """One step's decision (``StepGate.clip``): the factor each gradient is multiplied by as the update reads it
    (unscale and clip as torch clips; None: 1), never applied to all gradients at once, so no second copy of
    the step's totals exists (docs/memory.md, "update")."""

    norm: ms.Tensor  # the gradients' norm, unscaled
    ok: ms.Tensor  # whether it is finite (a device bool)
    coef: ms.Tensor | None  # a device scalar
    host_coef: float | None  # the host gate's read of ``coef``
    skip: bool  # the host gate's: the norm is not finite and no kernel runs


def clip_factor(norm: ms.Tensor, max_norm: float, grad_scale: ms.Tensor | None
                ) -> tuple[ms.Tensor | None, ms.Tensor, ms.Tensor]:
    """Nothing read: (the factor that unscales by ``grad_scale`` and clips to ``max_norm`` as torch clips (0: no
    clipping; None: the factor is 1); the unscaled norm; whether it is finite). ``norm`` is the norm of the
    gradients as given, scaled by ``grad_scale`` when that is set."""
    if grad_scale is not None:
        norm = norm / grad_scale
    ok = ops.isfinite(norm)
    coef = ops.where(norm > max_norm, max_norm / (norm + 1e-6), 1.0) if max_norm > 0 else None
    if grad_scale is not None:
        coef = 1.0 / grad_scale if coef is None else coef / grad_scale
    return coef, norm, ok


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
    v = ops.addcmul(v * k.beta2, g, g, value=1.0 - k.beta2)
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
        row = self.table.index_select(0, self.applied.reshape(1)).reshape(-1)
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
        self.on_device = not rank.platform.host_memory
        self.in_place = not self.on_device  # the host gate steps with the host kernel where it can
        self._step: KernelScalars | None = None  # the step whose scalars _host_scalars read
        self._k_host: tuple[float, ...] = ()
        self._wd_host: dict[int, float] = {}

    @property
    def on_host(self) -> bool:
        """Whether the step may work on the tensors' own memory with numpy (CPU; never on Ascend, where
        ``asnumpy`` would copy every tensor from the device)."""
        return self.in_place and not self.on_device

    def clip(self, norm: ms.Tensor, max_norm: float, grad_scale: ms.Tensor | None) -> Clip:
        """The step's :class:`Clip` for gradients of norm ``norm`` (scaled by ``grad_scale`` when set). On the
        host gate the norm and the factor are read (the step's one host read) and a non-finite norm skips the
        step."""
        coef, norm, ok = clip_factor(norm, max_norm, grad_scale)
        if self.on_device:
            return Clip(norm, ok, coef, None, False)
        read = (norm if coef is None else ops.stack([norm, coef])).asnumpy().reshape(-1)  # one host read
        value, factor = float(read[0]), (1.0 if coef is None else float(read[1]))
        if not math.isfinite(value):
            return Clip(norm, ok, None, None, True)
        return Clip(norm, ok, None, None, False) if factor == 1.0 else Clip(norm, ok, coef, factor, False)

    def update(self, w, m, v, k: KernelScalars, wd: ms.Tensor, g: ms.Tensor, clip: Clip
               ) -> tuple[ms.Tensor, ms.Tensor, ms.Tensor]:
        """One ``adamw_update`` of ``w`` with the gradient ``g`` times ``clip``'s factor: the (w, m, v) to keep
        (on the device gate the old moments when the step is skipped; ``w`` is then unchanged: lr' 0, the
        gradient zeroed). On the host gate, where w, m and v own their memory, the same step written into
        them (the same tensors returned), the factor applied chunk by chunk as the kernel reads ``g``."""
        if self.on_host:
            wh, mh, vh = (own_memory(t) for t in (w, m, v))
            if wh is not None and mh is not None and vh is not None:  # the host kernel, in place (optim/host.py)
                lr, beta1, beta2, eps, decay = self._host_scalars(k, wd)
                adamw_update_host(wh.reshape(-1), mh.reshape(-1), vh.reshape(-1), g.asnumpy().reshape(-1), lr, beta1,
                                  beta2, eps, decay, clip.host_coef)
                return w, m, v
        if clip.coef is not None:
            g = g * clip.coef
        if not self.on_device:
            return adamw_update(w, m, v, g, k, wd)
        w_new, m_new, v_new = adamw_update(w, m, v, ops.where(clip.ok, g, 0.0), k, wd)
        return w_new, ops.where(clip.ok, m_new, m), ops.where(clip.ok, v_new, v)

    def _host_scalars(self, k: KernelScalars, wd: ms.Tensor) -> tuple[float, ...]:
        """(lr', beta1, beta2, eps', wd) on the host, read once per step (``k``: a new one each step) and per
        decay value, not once per parameter (the step's ``wd`` tensors stay alive while it runs)."""
        if self._step is not k:
            self._step, self._k_host, self._wd_host = k, tuple(float(s.asnumpy()) for s in k[:4]), {}
        if id(wd) not in self._wd_host:
            self._wd_host[id(wd)] = float(wd.asnumpy())
        return (*self._k_host, self._wd_host[id(wd)])


def write_param(p: ms.Parameter, value: ms.Tensor) -> None:
    """Copy ``value`` into the storage of ``p`` (``Tensor.copy_``, the in-place copy that replaces the deprecated
    ``ops.assign``); nothing when ``value`` is ``p`` (the host kernel updated it in place)."""
    if value is p:
        return
    value = value if value.dtype == p.dtype else value.astype(p.dtype)
    if in_host_memory(value) and value.untyped_storage().nbytes() != value.nbytes:
        value = value.copy()  # MindSpore 2.10's CPU InplaceCopy refuses a view into a larger buffer
    # A gradient computation that raised (a kernel refusing its call: a self-test row) leaves PyNative recording,
    # where an in-place op on a leaf that requires grad is refused; this write is no part of any graph.
    # mindspore._no_grad is the context manager for that (2.10 exports no public no_grad).
    with ms._no_grad():
        p.copy_(value)
