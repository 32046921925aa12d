"""The optimizer kernel on the CPU's own memory: ``adamw_update``'s step written into w, m and v in place.

numpy updates the weights and moments where they are (``finetune/hostmem.py``: ``asnumpy`` shares a CPU
tensor's memory), in cache-sized chunks spread over this rank's cores: one pass over memory where the
composed kernel makes eight and allocates three new tensors, about 4x faster at the benchmark's 170 M
parameters (docs/speed.md).

The arithmetic is ``adamw_update``'s, operation for operation in fp32 with the scalars rounded as MindSpore
rounds them, so both give the same bits (tests/finetune/test_optim.py). Only where every one of w, m, v owns
its memory (``hostmem.own_memory``); the caller uses the composed kernel otherwise. Never on Ascend.
"""
from __future__ import annotations

import numpy as np

from finetune.hostmem import in_blocks

CHUNK = 1 << 15  # elements per task: w, m, v, g and one temporary of 128 KiB each stay in L2


def adamw_update_host(w: np.ndarray, m: np.ndarray, v: np.ndarray, g: np.ndarray, lr: float, beta1: float,
                      beta2: float, eps: float, wd: float, coef: float | None = None) -> None:
    """One AdamW step of the flat fp32 arrays ``w``, ``m``, ``v`` in place (``g`` is read): ``adamw_update``'s
    m' = m + (1 - b1)(g - m); v' = b2 v + (1 - b2) g^2; w' = w (1 - lr wd) - lr m' / (sqrt(v') + eps),
    with its fp32 scalars (the kernel's lr', eps' and ``wd * decay_factor``); g is ``g * coef`` when ``coef`` is
    set (the clip factor, ``StepGate.clip``: one chunk at a time, the fp32 product MindSpore's ``g * coef`` gives)."""
    f = np.float32
    one = f(1.0)
    k1, b2, k2, keep, lr_, eps_ = one - f(beta1), f(beta2), one - f(beta2), one - f(lr) * f(wd), f(lr), f(eps)
    scale = None if coef is None else f(coef)

    def part(lo: int, hi: int) -> None:
        wc, mc, vc, gc = w[lo:hi], m[lo:hi], v[lo:hi], g[lo:hi]
        if scale is not None:
            gc = gc * scale
        d = np.subtract(gc, mc)
        d *= k1
        mc += d
        vc *= b2
        np.multiply(gc, gc, out=d)
        d *= k2
        vc += d
        np.sqrt(vc, out=d)
        d += eps_
        np.divide(mc, d, out=d)
        d *= lr_
        wc *= keep
        wc -= d

    in_blocks(w.size, CHUNK, part)
