"""The DP gradient reduction, bucket by bucket, overlapped with the backward pass.

An optimizer cuts the gradients into buckets (``bucket_params[k]``: the parameters bucket ``k``
reads) and starts one asynchronous collective per bucket (``launch(k, grads)``, returning an object
whose ``wait()`` gives the bucket's reduced gradients). ``GradReduction`` calls ``launch`` from
per-parameter backward hooks (``Parameter.register_hook``, PyNative): a bucket's collective starts
as soon as the backward of the step's last micro-batch has produced every gradient it reads, while
the backward of the earlier layers still runs (MindSpeed's overlap-grad-reduce). Without overlap
(``parallel.overlap_grad_reduce: false``, or one DP rank) every bucket starts after the backward.

Every rank must issue the same collectives in the same order. Buckets are launched in one fixed
order, the last bucket first (the backward produces the last layers' gradients first), a bucket
only after every later one, whatever order the hooks fire in (activation recompute changes it).
So the sums are those of the synchronous reduction, bit for bit.
"""
from __future__ import annotations

import time
from typing import Any, Protocol

import mindspore as ms


class Bucketed(Protocol):
    """What an optimizer offers for its gradient reduction."""

    bucket_params: list[list[int]]  # the parameter indices each bucket reads

    def launch(self, k: int, grads: Any) -> Any:
        """Start reducing bucket ``k`` of ``grads`` (indexable by parameter index, fp32); an object
        whose ``wait()`` gives the result."""


def reduce_now(opt: Bucketed, grads: Any) -> list:
    """Every bucket reduced, launched in the fixed order (last first) and waited for."""
    pending = {k: opt.launch(k, grads) for k in reversed(range(len(opt.bucket_params)))}
    return [pending[k].wait() for k in range(len(pending))]


class GradReduction:
    """One step's fp32 gradient totals (micro-batches summed, then DP-reduced by ``opt``'s buckets).

    ``arm(acc)`` before the last micro-batch's backward (``acc``: the fp32 sum of the earlier
    micro-batches' gradients or None); ``finish(grads)`` after it, with the gradients it returned:
    the reduced buckets, as ``reduce_now`` gives them. ``comm_s``: host seconds spent launching and
    waiting for the collectives (``take_comm_s``).
    """

    def __init__(self, params: list, opt: Bucketed, overlap: bool):
        self.opt, self.overlap = opt, overlap
        self.names = [p.name for p in params]
        self.users: list[list[int]] = [[] for _ in params]  # the buckets reading each parameter
        for k, idx in enumerate(opt.bucket_params):
            for i in idx:
                self.users[i].append(k)
        self.comm_s = 0.0
        self.launched_after: list[int] = []  # per launch, in order: how many gradients had arrived
        self._start(None, armed=False)
        if overlap:
            for i, p in enumerate(params):
                p.register_hook(self._hook(i))

    def _start(self, acc: list | None, armed: bool) -> None:
        self.acc, self.armed = acc, armed
        self.totals: dict[int, ms.Tensor] = {}  # gradients arrived and not yet copied into a launched bucket
        self.arrived = [False] * len(self.users)
        self.missing = [len(idx) for idx in self.opt.bucket_params]
        self.next = len(self.missing) - 1  # the next bucket to launch
        self.pending: dict[int, Any] = {}

    def arm(self, acc: list | None) -> None:
        """The next backward is the step's last: launch buckets from its hooks (when overlapping)."""
        self._start(acc, armed=self.overlap)
        self.launched_after = []

    def _hook(self, i: int):
        def hook(grad: ms.Tensor) -> ms.Tensor:
            """Returns the gradient unchanged (the ``Tensor.register_hook`` contract of MindSpore 2.10)."""
            if self.armed:
                self._arrive(i, grad)
            return grad
        return hook

    def _arrive(self, i: int, grad: ms.Tensor) -> None:
        if self.arrived[i]:
            raise RuntimeError(f"the backward hook of {self.names[i]} ran twice in one backward: this MindSpore "
                               "version's hooks do not give one final gradient per parameter; set "
                               "OVERRIDES='parallel.overlap_grad_reduce=false' (reduce after the backward)")
        self.arrived[i] = True
        g = grad if grad.dtype == ms.float32 else grad.astype(ms.float32)
        self.totals[i] = g if self.acc is None else self.acc[i] + g
        for k in self.users[i]:
            self.missing[k] -= 1
        t0 = time.perf_counter()
        while self.next >= 0 and self.missing[self.next] == 0:
            k = self.next
            self.pending[k] = self.opt.launch(k, self.totals)
            self.launched_after.append(sum(self.arrived))
            for j in self.opt.bucket_params[k]:
                if self.users[j][0] == k:  # its first bucket: every bucket reading it is launched
                    del self.totals[j]
            self.next -= 1
        self.comm_s += time.perf_counter() - t0

    def finish(self, grads: tuple | list) -> list:
        """The reduced buckets of this step; ``grads``: what the last backward returned (used for
        the parameters whose hook did not run: all of them without overlap)."""
        self.armed = False
        for i, g in enumerate(grads):
            if not self.arrived[i]:
                self._arrive(i, g)
        t0 = time.perf_counter()
        out = [self.pending[k].wait() for k in range(len(self.pending))]
        self.comm_s += time.perf_counter() - t0
        self._start(None, armed=False)
        return out

    def take_comm_s(self) -> float:
        """The seconds since the last call."""
        spent, self.comm_s = self.comm_s, 0.0
        return spent
