"""The host softmax's row sums in reused scratch blocks (parallel/vocab.py ``host_row_sums``, ``scratch_rows``)."""
from __future__ import annotations

import numpy as np
import pytest

from finetune.parallel.vocab import HOST_ROWS, host_row_sums, scratch_rows


@pytest.mark.parametrize("tokens", [1, HOST_ROWS - 1, HOST_ROWS, 2 * HOST_ROWS + 5])
def test_row_sums_in_scratch_have_the_bits_of_a_fresh_temporary(tokens):
    a = (np.random.default_rng(tokens).standard_normal((tokens, 1000)) * 4).astype(np.float32)
    top, total = host_row_sums(a)
    want = np.exp(a - a.max(1)[:, None]).sum(1)  # the expression the scratch block replaced
    assert np.array_equal(top, a.max(1))
    assert np.array_equal(total.view(np.int32), want.view(np.int32))


def test_a_thread_reuses_its_scratch_block_until_the_vocabulary_changes():
    first = scratch_rows(1000)
    assert scratch_rows(1000) is first
    other = scratch_rows(999)
    assert other.shape == (HOST_ROWS, 999) and scratch_rows(999) is other
