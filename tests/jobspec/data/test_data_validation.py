"""Validation sets: data.val_size held out deterministically, data.val_paths, the eval micro-batches."""
from __future__ import annotations

import numpy as np
import pytest

from jobspec.data import cache
from jobspec.data.batching import BatchLoader
from jobspec.data.files import DataError
from jobspec.data.prepare import prepare
from jobspec.data.template import IGNORE
from tests.jobspec.data.data_helpers import alpaca, cache_of, is_fresh, recipe_for, write_jsonl


@pytest.fixture
def data(tmp_path):
    return write_jsonl(tmp_path / "d.jsonl", [alpaca(i) for i in range(40)])


def _val(info) -> np.ndarray:
    return np.load(info.dir / cache.VAL_INDEX)


def test_val_size_holds_out_a_fixed_share_never_trained_on(tmp_path, data):
    one = prepare(*cache_of(recipe_for(tmp_path / "1", [data], val_size="0.25", weights="2")), progress=False)
    two = prepare(*cache_of(recipe_for(tmp_path / "2", [data], val_size="0.25", weights="2")), progress=False)
    train, val = np.load(one.dir / "index.npy"), _val(one)
    assert len(val) == 10 == one.num_val == cache.load_info(one.dir).num_val
    assert len(train) == 2 * 30  # weight 2: each kept training sample twice, held-out ones not at all
    assert not set(val[:, 0]) & set(train[:, 0])
    assert np.array_equal(val, _val(two)) and np.array_equal(train, np.load(two.dir / "index.npy"))
    assert one.report["validation"]["samples"] == 10 and one.report["validation"]["from"] == "data.val_size=0.25"
    count = prepare(*cache_of(recipe_for(tmp_path / "3", [data], val_size="7")), progress=False)
    assert count.num_val == 7 and count.num_samples == 33
    with pytest.raises(DataError, match=r"data.val_size=40.0: holds out 40 of 40 samples"):
        prepare(*cache_of(recipe_for(tmp_path / "4", [data], val_size="40")), progress=False)


def test_val_paths_are_prepared_beside_training_and_make_the_cache_stale(tmp_path, data):
    v = write_jsonl(tmp_path / "v.jsonl", [alpaca(100 + i) for i in range(5)] + [alpaca(3)])  # one repeats train
    r = recipe_for(tmp_path, [data], val_paths=str(v))
    info = prepare(*cache_of(r), progress=False)
    assert info.num_samples == 40 and info.num_val == 5  # the repeat of a training sample is dropped (dedup)
    assert info.report["dropped"]["dedup"]["count"] == 1
    assert [s.get("validation", False) for s in info.report["sources"]] == [False, True]
    assert is_fresh(r)
    write_jsonl(v, [alpaca(200)])
    assert not is_fresh(r)
    assert not is_fresh(recipe_for(tmp_path, [data]))  # no validation set wanted now


@pytest.mark.parametrize("packing", [True, False])
def test_validation_batches_cover_every_sample_once_over_the_ranks(tmp_path, data, packing):
    info = prepare(*cache_of(recipe_for(tmp_path, [data], val_size="9")), progress=False)
    val = _val(info)
    labels = np.load(info.dir / "labels.npy")
    want = sum(int((labels[s + 1:s + n] != IGNORE).sum()) for s, n in val[:, :2].tolist())
    for dp in (1, 2, 3):
        ranks = [list(BatchLoader(info.dir, 128, 2, 1, dp, r, seed=0, packing=packing,
                                  index_name=cache.VAL_INDEX).eval_micro_batches()) for r in range(dp)]
        assert len(ranks[0]) >= 1
        # one shape, the training one: a short last micro-batch is filled with empty rows (compiled layers
        # compile once per shape)
        assert all(m["input_ids"].shape == (2, 128) and m["labels"].dtype == np.int32 for b in ranks for m in b)
        got = sum(int((m["labels"][:, 1:] != IGNORE).sum()) for b in ranks for m in b)
        assert got == want, dp  # a conversation starts with <|im_start|>, never a label: packing loses none
        # lockstep (ZeRO-3): every rank as many micro-batches as rank 0, the extra ones without labels
        lock = [list(BatchLoader(info.dir, 128, 2, 1, dp, r, seed=0, packing=packing, index_name=cache.VAL_INDEX)
                     .eval_micro_batches(lockstep=True)) for r in range(dp)]
        assert {len(b) for b in lock} == {len(ranks[0])}
        assert sum(int((m["labels"][:, 1:] != IGNORE).sum()) for b in lock for m in b) == want
    assert not (prepare(*cache_of(recipe_for(tmp_path / "n", [data])), progress=False).dir / cache.VAL_INDEX).exists()
    train = BatchLoader(info.dir, 128, 2, 1, 1, 0, seed=1, packing=packing)
    assert sum(len(u) for u in train.units) == 31
