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
from mindspore import ops

from finetune.collectives import Ready
from finetune.dist import RankInfo
from jobspec.layout import Layout
from jobspec.memory import IN_FLIGHT_BUCKETS


class Bucketed(Protocol):
    """What an optimizer offers for its gradient reduction."""

    bucket_params: list[list[int]]  # the parameter indices each bucket reads
    channel: Any  # the DP transport's Channel (finetune/transport.py; None without DP): ``sent`` to metrics

    def launch(self, k: int, grads: Any) -> Any:
        """Start reducing bucket ``k`` of ``grads`` (indexable by parameter index, fp32); an object
        whose ``wait()`` gives the result."""


def fp32(g: ms.Tensor) -> ms.Tensor:
    """``g`` in fp32 (itself when it is)."""
    return g if g.dtype == ms.float32 else g.astype(ms.float32)


def reduce_now(opt: Bucketed, grads: Any) -> list:
    """Every bucket reduced, launched in the fixed order (last first) and waited for."""
    pending = {k: opt.launch(k, grads) for k in reversed(range(len(opt.bucket_params)))}
    return [pending[k].wait() for k in range(len(pending))]


class GradReduction:
    """One step's fp32 gradient totals (micro-batches summed, then DP-reduced by ``opt``'s buckets).

    ``arm(acc)`` before the last micro-batch's backward (``acc``: the fp32 accumulator of the earlier
    micro-batches' gradients or None, ``add``); ``finish(grads)`` after it, with the gradients it returned:
    the reduced buckets, as ``reduce_now`` gives them. A
    bucket reads the accumulator itself, and drops it once launched. ``comm_s``: host seconds spent launching and
    waiting for the collectives (``take_comm_s``). ``compiled``: the decoder layers run as graphs
    (train.compile_layers), so a hook must not write the accumulator in place (``_arrive``).
    """

    def __init__(self, params: list, opt: Bucketed, overlap: bool, compiled: bool = False):
        self.opt, self.overlap, self.compiled = opt, overlap, compiled
        self.names = [p.name for p in params]
        self.users: list[list[int]] = [[] for _ in params]  # the buckets reading each parameter
        for k, idx in enumerate(opt.bucket_params):
            for i in idx:
                self.users[i].append(k)
        self.comm_s = 0.0
        self.views: set[int] = set()  # parameters whose gradient comes as a view (``_add``)
        # an untied embedding's gradient summed over the micro-batches as rows (parallel/vocab.py RowGradient):
        # the step's last backward returns the whole sum, the earlier ones a view of one zero
        self.by_rows = {i: p.row_grad for i, p in enumerate(params) if self.sums_rows and hasattr(p, "row_grad")}
        self.launched_after: list[int] = []  # per launch, in order: how many gradients had arrived
        self._start(None, armed=False)
        if overlap:
            for i in self.hooked(params):
                params[i].register_hook(self._hook(i))

    sums_rows = True  # ZeRO-2/3 reduce every micro-batch's whole gradients: not for them

    def _rows(self, mode: str) -> None:
        for grad in self.by_rows.values():
            grad.mode = mode

    def hooked(self, params: list) -> list[int]:
        """The parameters whose backward hooks report their gradients (overlap): all."""
        return list(range(len(params)))

    def taped(self, params: list) -> list:
        """The parameters the step's autodiff differentiates: all."""
        return params

    def add(self, acc: list | None, grads: list) -> list:
        """The fp32 accumulator ``acc`` (one tensor per trained parameter) with ``grads`` (one micro-batch's)
        added in place, or ``grads`` in fp32 adopted as it when there is none yet; ``grads`` is emptied as it
        is read, so each gradient is dropped once added."""
        if acc is None:
            acc = [None if i in self.by_rows else fp32(g).copy() if i in self.views else fp32(g)
                   for i, g in enumerate(grads)]
            grads.clear()
            return acc
        for i, g in enumerate(grads):
            if i not in self.by_rows:
                self._add(acc, i, g)
            grads[i] = None
        return acc

    def _add(self, acc: list, i: int, g: ms.Tensor) -> ms.Tensor:
        """``acc[i] += g`` in place: ``ops.assign_add`` writes its first input (measured on CPU, MindSpore 2.10:
        no allocation for fp32, one fp32 cast per tensor for bf16/fp16; ``Tensor.add_`` there returns a new
        tensor). It refuses a view (an adopted gradient may be one): that one is copied, and from then on copied
        when adopted (``views``)."""
        try:
            ops.assign_add(acc[i], fp32(g))
        except RuntimeError as e:
            if "view" not in str(e):
                raise
            self.views.add(i)
            acc[i] = acc[i].copy()
            ops.assign_add(acc[i], fp32(g))
        return acc[i]

    def _start(self, acc: list | None, armed: bool) -> None:
        self.acc, self.armed = acc, armed
        self._rows("rows")
        self.totals: dict[int, ms.Tensor] = {}  # gradients arrived and not yet copied into a launched bucket
        self.arrived = [False] * len(self.users)
        self.missing = [len(idx) for idx in self.opt.bucket_params]
        self.next = len(self.missing) - 1  # the next bucket to launch
        self.pending: dict[int, Any] = {}

    def arm(self, acc: list | None) -> None:
        """The next backward is the step's last: launch buckets from its hooks (when overlapping)."""
        self._start(acc, armed=self.overlap)
        self._rows("dense")
        self.launched_after = []

    def _hook(self, i: int):
        def hook(grad: ms.Tensor) -> ms.Tensor:
            """Returns the gradient unchanged (the ``Tensor.register_hook`` contract of MindSpore 2.10)."""
            if self.armed:
                self._arrive(i, grad, in_backward=True)
            return grad
        return hook

    def _arrive(self, i: int, grad: ms.Tensor, in_backward: bool = False) -> None:
        """Gradient ``i`` of the last micro-batch is final: added to the accumulator and counted for its buckets.
        From a hook (``in_backward``) with compiled layers the sum is a new tensor: MindSpore 2.10 fails a compiled
        layer's backward ("Failure info [Size not match]", pynative_jit_grad.cc FilterGradOutput) when a hook writes
        in place into the accumulator, whose tensors are the first micro-batch's gradients, adopted (a copy of them
        it may write; op by op, recompute included, it fails neither); the accumulator's tensor is dropped as the
        sum replaces it."""
        if self.arrived[i]:
            raise RuntimeError(f"the backward hook of {self.names[i]} ran twice in one backward: this MindSpore "
                               "version's hooks do not give one final gradient per parameter; set "
                               "OVERRIDES='parallel.overlap_grad_reduce=false' (reduce after the backward)")
        self.arrived[i] = True
        if self.acc is None or i in self.by_rows:
            self.totals[i] = fp32(grad)
        elif in_backward and self.compiled:
            self.totals[i], self.acc[i] = self.acc[i] + fp32(grad), None
        else:
            self.totals[i] = self._add(self.acc, i, grad)
        for k in self.users[i]:
            self.missing[k] -= 1
        t0 = time.perf_counter()
        while self.next >= 0 and self.missing[self.next] == 0:
            k = self.next
            self.pending[k] = self._launch(k)
            self.launched_after.append(sum(self.arrived))
            for j in self.opt.bucket_params[k]:
                if self.users[j][0] == k:  # its first bucket: every bucket reading it is launched
                    del self.totals[j]
                    if self.acc is not None:
                        self.acc[j] = None
            self.next -= 1
        self.comm_s += time.perf_counter() - t0

    def _launch(self, k: int) -> Any:
        return self.opt.launch(k, self.totals)

    def _wait_all(self) -> list:
        """Every bucket's flight, in bucket order."""
        return [self.pending[k] for k in range(len(self.pending))]

    def finish(self, grads: tuple | list) -> list:
        """The reduced buckets of this step; ``grads``: what the last backward returned (used for
        the parameters whose hook did not run: all of them without overlap; a list is emptied as it is read)."""
        self.armed = False
        for i, g in enumerate(grads):
            if not self.arrived[i]:
                self._arrive(i, g)
            if isinstance(grads, list):
                grads[i] = None
        t0 = time.perf_counter()
        out = [f.wait() for f in self._wait_all()]
        self.comm_s += time.perf_counter() - t0
        self._start(None, armed=False)
        return out

    def take_comm_s(self) -> float:
        """The seconds since the last call."""
        spent, self.comm_s = self.comm_s, 0.0
        return spent


class ShardedAccumulation(GradReduction):
    """ZeRO-2 (``layout.shard_gradients``): every micro-batch's gradients are reduce-scattered over DP by the
    sharded optimizer's buckets, launched from its backward hooks when overlapping (armed for every backward,
    not only the last), and each rank adds only its own fp32 chunks: no whole fp32 gradient outlives its
    micro-batch. ``sums``: the step's chunk sums so far (per bucket, None before its first chunk), each chunk
    added as soon as it is waited for, so no micro-batch's chunks are alive all at once beside them."""

    sums_rows = False

    def __init__(self, params: list, opt: Bucketed, overlap: bool):
        super().__init__(params, opt, overlap)
        self.sums: list = [None] * len(opt.bucket_params)
        self._start(None, armed=overlap)

    def _reduce(self, grads: tuple | list) -> list:
        """This micro-batch's chunks added to the step's sums; the hooks armed again for the next backward."""
        super().finish(grads)
        self._start(None, armed=self.overlap)
        return self.sums

    def add(self, acc: list | None, grads: list) -> list:
        self._reduce(grads)
        grads.clear()
        return self.sums

    def _launch(self, k: int) -> Any:
        """Bucket ``k``'s reduce-scatter, launched once at most ``IN_FLIGHT_BUCKETS`` - 1 others are in flight (the
        oldest waited for and added): each holds its bucket's flat fp32 copy (a shared-memory sum: a region) until
        waited, so without this every bucket's would outlive the backward, a whole fp32 gradient again
        (``jobspec.memory``: ``rs_buckets``)."""
        flying = [j for j, f in self.pending.items() if not isinstance(f, Added)]  # oldest first
        for j in flying[:max(0, len(flying) - IN_FLIGHT_BUCKETS + 1)]:
            self.pending[j] = self._add_chunk(j, self.pending[j])
        return super()._launch(k)

    def _add_chunk(self, k: int, flight: Any) -> Added:
        """Bucket ``k``'s chunk (waited for) added to ``sums[k]`` in place, or copied as it (a chunk may be a view,
        or a transport's buffer)."""
        chunk = flight.wait()
        if self.sums[k] is None:
            self.sums[k] = chunk.copy()
        else:
            ops.assign_add(self.sums[k], chunk)
        return Added(self.sums[k])

    def _wait_all(self) -> list:
        return [f if isinstance(f, Added) else self._add_chunk(k, f) for k, f in sorted(self.pending.items())]

    def arm(self, acc: list | None) -> None:
        self.launched_after = []  # the hooks are armed already; ``acc`` is ``sums``

    def finish(self, grads: tuple | list) -> list:
        out = self._reduce(grads)
        self.sums = [None] * len(out)
        return out


class Added(Ready):
    """A bucket's chunk already added to the step's sums (``ShardedAccumulation``)."""


def reduction_for(params: list, opt: Bucketed, layout: Layout, rank: RankInfo, compiled: bool) -> GradReduction:
    """The step's gradient reduction for the plan's ``layout``: ZeRO-2's per-micro-batch one when it shards
    the gradients (ZeRO-3's is ``zero3.Zero3Reduction``)."""
    if not layout.shard_gradients:
        reduction = GradReduction(params, opt, layout.overlap_grad_reduce, compiled)
        if reduction.by_rows:
            rank.log("[train] the embedding's gradient is summed as the rows each micro-batch looks up, whole in "
                     "numpy at the step's last backward (no [vocab, hidden] accumulator: host memory, untied, fp32 or "
                     "fp16; parallel/vocab.py RowGradient)")
        return reduction
    rank.log("[train] ZeRO-2: each micro-batch's gradients reduce-scattered over DP, each rank accumulating its "
             "own fp32 chunks")
    return ShardedAccumulation(params, opt, layout.overlap_grad_reduce)
