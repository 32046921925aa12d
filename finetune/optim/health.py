"""What the training loop tracks of the optimizer's steps: the fp16 loss scale, the skipped steps
and the check that an applied step changed the weights."""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import ops

from finetune.optim.adamw import Optimizer
from jobspec.config import LossScaleConfig


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
                "versions against docs/container.md and run the self-test (make selftest) on this host")
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
        self.counts = ops.zeros((3,), dtype=ms.float32)

    def update(self, ok: ms.Tensor) -> None:
        bad = 1.0 - ok.astype(ms.float32)
        run = (self.counts[1] + 1.0) * bad
        self.counts = ops.stack([self.counts[0] + bad, run, ops.maximum(self.counts[2], run)])

    def read(self) -> None:
        """The counts were read: the ones "since the last read" start again."""
        self.counts = self.counts * ms.Tensor(np.array([0.0, 1.0, 0.0], np.float32))
