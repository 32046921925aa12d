"""The derived fp32 tolerance admits the same sum in another order and refuses a real difference."""
from __future__ import annotations

import numpy as np
import pytest

from tests.tolerances import assert_fp32_close, fp32_atol


@pytest.mark.parametrize("n", [16, 768, 65536])
def test_sums_in_any_order_are_within_the_bound(n):
    """Sequential, pairwise (numpy) and blocked sums of the same fp32 products agree within fp32_atol."""
    rng = np.random.default_rng(n)
    terms = rng.standard_normal((64, n)).astype(np.float32) * rng.standard_normal((64, n)).astype(np.float32)
    pairwise = terms.sum(axis=1)
    sequential = np.zeros(64, np.float32)
    for column in terms.T:
        sequential += column
    blocked = terms.reshape(64, -1, 16).sum(axis=2, dtype=np.float32).sum(axis=1, dtype=np.float32)
    for other in (sequential, blocked):
        assert_fp32_close(other, pairwise, n)
    assert not np.array_equal(sequential, pairwise)  # the orders really round differently


def test_a_difference_above_rounding_is_refused():
    """A gradient one part in 1e4 of its scale off (a wrong factor, a dropped token) fails."""
    ref = np.random.default_rng(0).standard_normal(128).astype(np.float32)
    assert fp32_atol(ref, 24 * 32) < 1e-4 * np.abs(ref).max()
    bad = ref.copy()
    bad[7] += 1e-4 * np.abs(ref).max()
    with pytest.raises(AssertionError):
        assert_fp32_close(bad, ref, 24 * 32)
