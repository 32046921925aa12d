"""Vocabulary-parallel layers: the token embedding, the LM head and the parallel cross-entropy.

With vocab-parallel tensor parallelism each TP rank holds a contiguous slice of the vocabulary rows
(``jobspec.model_layout`` decides which); otherwise the rows are replicated and no collective is made.
"""
from __future__ import annotations

import threading
from typing import NamedTuple

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer

from finetune.dist import RankInfo
from finetune.hostmem import in_blocks, own_memory
from finetune.parallel.layers import ReduceFromTP


class VocabRange(NamedTuple):
    """The token ids ``[start, start + size)`` whose rows this rank holds (all of them when not split)."""

    start: int
    size: int

    def local(self, ids):
        """``(ids - start)`` clipped to a valid row and an fp32 mask of the ids this rank holds."""
        local = ids - self.start
        inside = ops.logical_and(local >= 0, local < self.size)
        return ops.where(inside, local, ops.zeros_like(local)), inside.astype(ms.float32)


class TiedGradient:
    """A trained tied embedding's gradient built in one ``[vocab, hidden]`` fp32 buffer (host memory, vocabulary
    whole on the rank): the LM head's backward leaves its d weight in ``head`` (its weight input is under
    ``stop_gradient``), the lookup's backward (:class:`TiedLookup`) adds its rows into that buffer in place and
    returns it as the weight's only gradient. Autodiff would hold the head's d weight, the lookup's dense d weight
    and their sum together (docs/memory.md, ``tied``); the values are the same bit for bit: the lookup's rows are
    summed per token id in token order from zero, as MindSpore's IndexSelect gradient sums them, then added to the
    head's rows (tests/finetune/test_tied_grad.py)."""

    def __init__(self) -> None:
        self.head: Tensor | None = None


class HostLookup(nn.Cell):
    """``weight[ids]``, for a subclass to give a backward of its own on the host (:func:`lookup_rows`)."""

    def construct(self, w, ids):
        return w.index_select(0, ids.reshape(-1)).reshape(*ids.shape, -1)


class TiedLookup(HostLookup):
    """``weight[ids]`` whose backward returns the head's d weight (``TiedGradient.head``) with the lookup's rows
    added in place (a zero buffer when the head left none: a micro-batch without labels)."""

    def __init__(self, tied: TiedGradient):
        super().__init__()
        self.tied = tied

    def bprop(self, w, ids, out, dout):
        head, self.tied.head = self.tied.head, None
        a = None if head is None else own_memory(head)
        if a is None:
            a = np.zeros(w.shape, np.float32) if head is None else head.asnumpy().copy()
            head = ms.from_numpy(a)
        rows, sums = lookup_rows(ids, dout, a.shape[1])
        a[rows] += sums
        return head, ops.zeros_like(ids)


def lookup_rows(ids, dout, hidden: int) -> tuple[np.ndarray, np.ndarray]:
    """A lookup's gradient as (the sorted distinct token ids, their rows of ``dout`` summed, in fp32): each id's rows
    summed in token order from zero in ``dout``'s dtype (fp32 or fp16), as MindSpore's IndexSelect gradient sums
    them into its dense ``[vocab, hidden]`` gradient, then cast as the accumulator casts that gradient (bit for bit:
    tests/finetune/test_tied_grad.py, test_row_grad.py)."""
    rows, inverse = np.unique(ids.asnumpy().reshape(-1), return_inverse=True)
    d = dout.asnumpy().reshape(-1, hidden)
    sums = np.zeros((rows.size, hidden), d.dtype)
    np.add.at(sums, inverse.reshape(-1), d)
    return rows, sums.astype(np.float32, copy=False)


class RowGradient:
    """An untied embedding's gradient over one step's micro-batches kept as its rows (host memory, the whole
    vocabulary on the rank, fp32 or fp16 weights): the ids the step looked up and their summed rows, not a
    ``[vocab, hidden]`` fp32 accumulator alive through every later micro-batch's forward and LM head
    (docs/memory.md, ``accumulator``). The gradient reduction sets ``mode`` (``parallel/overlap.py``
    GradReduction): "off", autodiff's own dense gradient (no reduction took it: ZeRO-2/3); "rows", the
    micro-batch's rows added to the step's and a zero returned (a view of one element); "dense", the step's last
    (or only) micro-batch: its rows added, the step's whole gradient returned as one fp32 numpy buffer (returned to
    the system when freed, where MindSpore's pool keeps its blocks) and the rows dropped. Each element is the same
    fp32 sum in the same order as the dense accumulator's (an absent row adds zero, exactly)."""

    def __init__(self) -> None:
        self.mode = "off"
        self.rows = np.zeros(0, np.int64)
        self.sums: np.ndarray | None = None

    def add(self, rows: np.ndarray, sums: np.ndarray) -> None:
        """One micro-batch's distinct ids and summed rows added to the step's."""
        if self.sums is None:
            self.rows, self.sums = rows, sums
            return
        union = np.union1d(self.rows, rows)
        out = np.zeros((union.size, sums.shape[1]), np.float32)
        out[np.searchsorted(union, self.rows)] = self.sums
        out[np.searchsorted(union, rows)] += sums
        self.rows, self.sums = union, out

    def take(self, shape: tuple[int, int]) -> np.ndarray:
        """The step's gradient as one dense fp32 array; the rows dropped."""
        dense = np.zeros(shape, np.float32)
        if self.sums is not None:
            dense[self.rows] = self.sums
        self.rows, self.sums = np.zeros(0, np.int64), None
        return dense


class RowLookup(HostLookup):
    """``weight[ids]`` whose backward adds the rows to the step's :class:`RowGradient` (modes there)."""

    def __init__(self, grad: RowGradient):
        super().__init__()
        self.grad = grad

    def bprop(self, w, ids, out, dout):
        self.grad.add(*lookup_rows(ids, dout, w.shape[1]))
        if self.grad.mode == "dense":
            return ms.from_numpy(self.grad.take(w.shape)), ops.zeros_like(ids)
        # a view of one zero, fp32 whatever the weight's dtype: MindSpore 2.10 casts an fp16 one to a whole
        # [vocab, hidden] fp32 tensor (measured on CPU), as it leaves the dense mode's fp32 gradient of fp16 weights
        return ops.zeros((1, 1), dtype=ms.float32).broadcast_to(w.shape), ops.zeros_like(ids)


class Embedding(nn.Cell):
    """Token embedding: replicated, or vocab-parallel (each TP rank looks up its rows, then a TP sum)."""

    def __init__(self, vocab: int, hidden: int, compute_dtype, rank: RankInfo = RankInfo(),
                 rows: VocabRange | None = None):
        """``rows``: this rank's slice of the vocabulary (None: all of it)."""
        super().__init__()
        self.rows = rows or VocabRange(0, vocab)
        self.weight = Parameter(initializer(Normal(0.02), (self.rows.size, hidden), ms.float32), name="weight")
        self.dtype = compute_dtype
        self.split = self.rows.size != vocab
        self.reduce = ReduceFromTP(rank) if self.split else None
        self.lookup: TiedLookup | None = None  # tie(): a trained tied weight's gradient built in place
        self.row_lookup: RowLookup | None = None  # by_rows(): an untied weight's gradient kept as rows

    def tie(self, tied: TiedGradient) -> None:
        """Build this weight's gradient in the LM head's d weight (``TiedGradient``) while the weight is trained."""
        self.lookup = TiedLookup(tied)

    def by_rows(self) -> None:
        """Accumulate this (untied, whole, fp32 or fp16) weight's gradient over micro-batches as rows
        (:class:`RowGradient`, ``weight.row_grad``: the gradient reduction sets its mode)."""
        self.weight.row_grad = RowGradient()
        self.row_lookup = RowLookup(self.weight.row_grad)

    def construct(self, ids):
        if self.lookup is not None and self.weight.requires_grad:
            return self.lookup(self.weight, ids).astype(self.dtype)
        if self.row_lookup is not None and self.weight.row_grad.mode != "off" and self.weight.requires_grad:
            return self.row_lookup(self.weight, ids).astype(self.dtype)
        if not self.split:
            return self.weight.index_select(0, ids.reshape(-1)).reshape(*ids.shape, -1).astype(self.dtype)
        local, inside = self.rows.local(ids)  # ids held elsewhere read row 0 and are zeroed
        rows = self.weight.index_select(0, local.reshape(-1)).reshape(*local.shape, -1)
        x = rows * inside.unsqueeze(-1).astype(self.weight.dtype)
        return self.reduce(x.astype(self.dtype))


class LMHead(nn.Cell):
    """Untied output projection ``[vocab, hidden]`` (``[vocab / tp, hidden]`` when vocab-parallel)."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.weight = Parameter(initializer(Normal(0.02), (vocab, hidden), ms.float32), name="weight")


class LMHeadCrossEntropy(nn.Cell):
    """``sum(-log_softmax(h @ w.T)[target])`` in fp32 with a hand-written backward.

    MindSpore's autodiff of log_softmax over a 150k vocabulary is several times slower on CPU than
    the closed form ``dlogits = softmax - onehot``. ``chunk_tokens`` > 0 computes both over chunks
    of that many tokens (``d weight`` summed in fp32), so the ``[tokens, vocab]`` fp32 buffers shrink
    to ``[chunk, vocab]``; the sums are the same up to rounding order. In training mode
    (``Cell.set_train``: the trainer's, not evaluation's) a forward whose tokens fit in one chunk
    keeps its logits for the backward (one ``[tokens, vocab]`` fp32 buffer, within the head's peak
    the memory estimate counts); otherwise the backward recomputes each chunk's logits
    (bit-identical: the same matmul), so at most one chunk's are alive.

    Vocab-parallel (``rows`` a slice of the vocabulary, ``rank.tp > 1``): each TP rank holds the
    logits of its rows only. The row maxima, the sums of exponentials and the target logits are
    combined over the TP group, so every rank returns the whole loss; backward, each rank's
    ``d hidden`` covers its rows and is summed over the TP group.

    On CPU in fp32 (``host_gemm``) the three vocab-sized matmuls run in numpy's BLAS on the tensors'
    own memory (``asnumpy`` shares it on CPU, finetune/hostmem.py): MindSpore 2.10's CPU MatMul takes
    about 1.5x OpenBLAS's time at these shapes (docs/speed.md). Unsplit, the softmax is numpy's too: the
    forward keeps each row's max and sum of exponentials instead of a log-softmax buffer, and the backward writes
    softmax - onehot over the kept logits (``host_softmax_minus_onehot``), about 3x faster than
    MindSpore's softmax and scatter, which allocate two more ``[tokens, vocab]`` buffers. Elsewhere
    they are MindSpore ops.
    """

    def __init__(self, compute_dtype, rank: RankInfo = RankInfo(), rows: VocabRange | None = None,
                 chunk_tokens: int = 0):
        super().__init__()
        self.dtype = compute_dtype
        self.chunk = chunk_tokens  # > 0: logits of at most this many tokens alive at a time
        self.host_gemm = rank.platform.host_memory and compute_dtype == ms.float32
        self.mm = {(False, False): ops.MatMul(), (False, True): ops.MatMul(transpose_b=True),
                   (True, False): ops.MatMul(transpose_a=True)}
        self.split = rows is not None and rank.tp > 1  # rows: this rank's slice when vocab-parallel
        self.rows, self.tp, self.tp_rank = rows, rank.tp, rank.tp_rank
        self.tp_sum = ops.AllReduce(ops.ReduceOp.SUM, rank.tp_group) if self.split else None
        self.kept = None  # a training forward's single-chunk logits, taken by its backward
        self.weight_grad = True  # False: the head's weight is frozen (LoRA), its gradient is zeros, not computed
        self.tied: TiedGradient | None = None  # set: the d weight goes there, not to autodiff (TiedGradient)

    @property
    def host_softmax(self) -> bool:
        """The softmax in numpy too: the host GEMM's path when the vocabulary is whole on this rank."""
        return self.host_gemm and not self.split

    def _gemm(self, a, b, ta: bool = False, tb: bool = False):
        """``a @ b``, ``a`` or ``b`` transposed when asked, in the compute dtype."""
        if self.host_gemm:
            x, y = a.asnumpy(), b.asnumpy()
            return ms.from_numpy(np.matmul(x.T if ta else x, y.T if tb else y))
        return self.mm[ta, tb](a.astype(self.dtype), b.astype(self.dtype))

    def _logits(self, h, w):
        return self._gemm(h, w, tb=True).astype(ms.float32)

    def _softmax_parts(self, logits, target):
        """Vocab-parallel: (row max over all ranks, sum of exp(logits - max) over all ranks,
        this rank's target logit or 0, local target column, 1.0 where this rank holds the target)."""
        local_max = ops.amax(logits, -1)
        slots = [local_max if i == self.tp_rank else ops.zeros_like(local_max) for i in range(self.tp)]
        row_max = ops.amax(self.tp_sum(ops.stack(slots)), 0)  # exact: one AllReduce of tp x tokens values
        col, inside = self.rows.local(target)
        picked = ops.gather_elements(logits, 1, col.reshape(-1, 1)).reshape(-1) * inside
        return row_max, ops.exp(logits - row_max.unsqueeze(-1)).sum(-1), picked, col, inside

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        c = self.chunk if 0 < self.chunk < n else n
        return [(a, min(a + c, n)) for a in range(0, n, c)]

    def construct(self, h, w, target):
        parts = self._chunks(h.shape[0])
        if len(parts) == 1:
            logits = self._logits(h, w)
            loss, sums = self._loss(h, w, target, logits)
            self.kept = (logits, sums) if self.training else None
            return loss
        self.kept = None
        total = self._loss(h[:parts[0][1]], w, target[:parts[0][1]])[0]
        for a, b in parts[1:]:
            total = total + self._loss(h[a:b], w, target[a:b])[0]
        return total

    def bprop(self, h, w, target, out, dout):
        parts = self._chunks(h.shape[0])
        if len(parts) == 1:
            kept, self.kept = self.kept, None  # None (not training mode): recomputed
            dh, dw = self._grads(h, w, target, dout, *(kept or ()))
            return dh.astype(h.dtype), self._weight_grad(dw, w), ops.zeros_like(target)
        dhs, dw = [], None
        for a, b in parts:
            dh_c, dw_c = self._grads(h[a:b], w, target[a:b], dout)
            dhs.append(dh_c)
            if dw_c is not None:
                dw = dw_c.astype(ms.float32) if dw is None else dw + dw_c.astype(ms.float32)
        return ops.cat(dhs, 0).astype(h.dtype), self._weight_grad(dw, w), ops.zeros_like(target)

    def _weight_grad(self, dw, w):
        """The head weight's gradient; a frozen head's (``weight_grad`` off, LoRA) is one zero, not a
        vocab x hidden tensor of zeros per micro-batch (nothing reads it: the weight takes no gradient), as is a
        tied one's: its d weight goes to the lookup's backward (``TiedGradient``)."""
        if dw is not None and self.tied is not None:
            self.tied.head, dw = dw.astype(ms.float32), None
        return ops.zeros((), dtype=w.dtype) if dw is None else dw.astype(w.dtype)

    def _loss(self, h, w, target, logits=None):
        """(the loss sum of one chunk of tokens, its rows' (max, sum of exp) on the host path or None;
        ``logits``: already computed)."""
        logits = self._logits(h, w) if logits is None else logits
        if self.host_softmax:
            a, t = logits.asnumpy(), target.asnumpy()
            top, total = sums = host_row_sums(a)
            return Tensor(np.float32((np.log(total) + top - a[np.arange(t.size), t]).sum())), sums
        if not self.split:
            logp = ops.log_softmax(logits, -1)
            return -ops.gather_elements(logp, 1, target.reshape(-1, 1)).sum(), None
        row_max, sum_exp, picked, _, _ = self._softmax_parts(logits, target)
        total = self.tp_sum(ops.stack((sum_exp, picked)))  # [2, tokens]: sums over every rank's rows
        return (ops.log(total[0]) + row_max - total[1]).sum(), None

    def _grads(self, h, w, target, dout, logits=None, sums=None):
        """(d hidden, d weight or None when ``weight_grad`` is off) of one chunk of tokens, in the compute dtype
        (``logits``, ``sums``: kept from the forward)."""
        logits = self._logits(h, w) if logits is None else logits
        if self.host_softmax:  # softmax - onehot written over the logits, used by nothing else
            p = host_softmax_minus_onehot(logits, target.asnumpy(), sums)
        else:
            if not self.split:
                p = ops.softmax(logits, -1)
                col, hit = target.reshape(-1, 1), 1.0
            else:
                row_max, sum_exp, _, col, inside = self._softmax_parts(logits, target)
                p = ops.exp(logits - row_max.unsqueeze(-1)) / self.tp_sum(sum_exp).unsqueeze(-1)
                col, hit = col.reshape(-1, 1), inside.reshape(-1, 1)
            p = p.scatter(1, col, ops.gather_elements(p, 1, col) - hit).astype(self.dtype)
        dh = self._gemm(p, w) * dout.astype(self.dtype)
        if self.split:  # every rank's rows contribute to d hidden
            dh = self.tp_sum(dh)
        if not self.weight_grad:
            return dh, None
        dw = self._gemm(p, (h.astype(ms.float32) * dout).astype(self.dtype), ta=True)
        return dh, dw


HOST_ROWS = 16  # rows of logits per task of the host softmax (16 x 151936 fp32: 9.7 MB)
_scratch = threading.local()  # each pool thread's HOST_ROWS x vocab fp32 block, reused call after call


def scratch_rows(vocab: int) -> np.ndarray:
    """This thread's ``[HOST_ROWS, vocab]`` fp32 scratch block, allocated on its first use for this vocabulary.
    A fresh 9.7 MB temporary per row block was mapped and zeroed afresh by glibc (the launcher's 1 MiB mmap
    threshold): 21 k page faults per 512-token micro-batch (docs/speed.md)."""
    buf = getattr(_scratch, "rows", None)
    if buf is None or buf.shape[1] != vocab:
        buf = _scratch.rows = np.empty((HOST_ROWS, vocab), np.float32)
    return buf


def host_row_sums(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's (max, sum of exp(logit - max)) of the fp32 logits ``a`` ([tokens, vocab]), row blocks over
    the cores, each in its thread's reused scratch block."""
    top, total = np.empty(a.shape[0], np.float32), np.empty(a.shape[0], np.float32)

    def rows(lo: int, hi: int) -> None:
        blk = a[lo:hi]
        top[lo:hi] = blk.max(1)
        tmp = scratch_rows(a.shape[1])[:hi - lo]
        np.subtract(blk, top[lo:hi, None], out=tmp)
        total[lo:hi] = np.exp(tmp, out=tmp).sum(1)

    in_blocks(a.shape[0], HOST_ROWS, rows)
    return top, total


def host_softmax_minus_onehot(logits: Tensor, target: np.ndarray, sums: tuple[np.ndarray, np.ndarray] | None
                              ) -> Tensor:
    """softmax(logits) - onehot(target), the cross-entropy's gradient by its logits, written over ``logits``'
    memory (a copy when it has none of its own): exp(logits - max) / sum per row block (``sums``: the
    forward's ``host_row_sums``), then 1 off each target."""
    a = own_memory(logits)
    if a is None:
        a = logits.asnumpy().copy()
        logits = ms.from_numpy(a)
    top, total = host_row_sums(a) if sums is None else sums

    def rows(lo: int, hi: int) -> None:
        blk = a[lo:hi]
        blk -= top[lo:hi, None]
        np.exp(blk, out=blk)
        blk /= total[lo:hi, None]

    in_blocks(a.shape[0], HOST_ROWS, rows)
    a[np.arange(target.size), target] -= np.float32(1.0)
    return logits
