"""Floating-point tolerances derived from the computation's size, not from the CPU a test was written on.

Two correct fp32 results of the same sums differ by their summation order: numpy, MindSpore and torch pick
it per CPU (SSE, AVX2, AVX-512, NEON block sizes), so a tolerance tuned to one machine's rounding fails on
another. The probabilistic bound of Higham and Mary (SIAM J. Sci. Comput. 41(5), 2019, Theorem 3.1) gives
the error of a sum of n terms in any order as at most lambda * sqrt(n) * u * sum|terms|, u = 2^-24 the fp32 unit
roundoff, with probability at least 1 - 2n exp(-lambda^2 / 2): lambda = 6 makes that 1 - 3e-8 per sum. Each side of
a comparison carries such an error, hence the factor 2. A test does not see sum|terms|; the largest
magnitude of the reference array stands for it, since every element of a gradient or an activation is built
from the same products, so an element near zero gets its array's tolerance, not one scaled to itself.
"""
from __future__ import annotations

import math

import numpy as np

U32 = 2.0 ** -24  # fp32 unit roundoff
LAMBDA = 6.0


def fp32_atol(reference: np.ndarray, terms: int) -> float:
    """The absolute tolerance between two fp32 evaluations of `reference`, each element a sum of `terms`."""
    return 2 * LAMBDA * math.sqrt(max(terms, 1)) * U32 * float(np.max(np.abs(reference)))


def assert_fp32_close(actual: np.ndarray, reference: np.ndarray, terms: int, err_msg: str = "") -> None:
    """actual equals reference up to the rounding of `terms`-term fp32 sums done in another order."""
    np.testing.assert_allclose(actual, reference, rtol=0, atol=fp32_atol(reference, terms), err_msg=err_msg)


def total_rtol(term_atol: float, terms: int, total: float) -> float:
    """The relative tolerance of a sum of `terms` values each within `term_atol` (a document's log-likelihood from its
    tokens' log-probabilities), which also bounds what is linear in it: log perplexity, bits per byte."""
    return term_atol * terms / abs(total)
