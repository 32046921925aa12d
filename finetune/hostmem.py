"""CPU tensors as numpy arrays on their own memory, and the thread pool that works on them.

On CPU a tensor's memory is the host's, and ``Tensor.asnumpy`` returns an ndarray that "shares the same
underlying storage" (its docstring, MindSpore 2.10: a write to the array is a write to the tensor), so
numpy (and its BLAS) can read and update tensors where they are. ``asnumpy`` of a view (a slice, a
reshape of a slice) returns a copy instead, so :func:`own_memory` compares addresses before anyone
writes. The hot loops that use this: the LM head's matmuls and softmax (``parallel/vocab.py``) and the
AdamW step (``optim/host.py``); never on Ascend (device memory).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import mindspore as ms
import numpy as np


def _shares(a: np.ndarray, t: ms.Tensor) -> bool:
    """Whether ``a`` (``t.asnumpy()``) is ``t``'s memory rather than a copy of it."""
    return bool(a.ctypes.data == t.data_ptr())


def own_array(t: ms.Tensor) -> np.ndarray | None:
    """The ndarray on ``t``'s own memory, or None when ``asnumpy`` would give a copy (a view)."""
    if not t.is_contiguous():
        return None
    a = t.asnumpy()
    return a if _shares(a, t) and a.flags.writeable else None


def own_memory(t: ms.Tensor) -> np.ndarray | None:
    """The fp32 ndarray on ``t``'s own memory, or None (another dtype, or a view)."""
    return own_array(t) if t.dtype == ms.float32 else None


def snapshot(t: ms.Tensor) -> np.ndarray:
    """``t``'s values now, as an ndarray later in-place steps leave alone (a copy where ``asnumpy`` shares
    ``t``'s memory, i.e. on CPU; on Ascend ``asnumpy`` copies from the device already)."""
    a = t.asnumpy()
    return a.copy() if _shares(a, t) else a


@cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(len(os.sched_getaffinity(0)), thread_name_prefix="hostmem")


def in_blocks(n: int, block: int, work: Callable[[int, int], None]) -> None:
    """``work(lo, hi)`` over [0, n) in blocks of ``block``, spread over this rank's cores (numpy releases
    the GIL in its loops)."""
    list(_pool().map(lambda lo: work(lo, min(lo + block, n)), range(0, n, block)))
