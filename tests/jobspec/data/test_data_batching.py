"""BatchLoader on a synthetic cache: packing, order, resume, DP slices, label counts, budgets."""
from __future__ import annotations

import json

import numpy as np
import pytest

from jobspec.data.batching import BatchLoader, pack_ffd
from jobspec.data.template import IGNORE

SEQ = 64


@pytest.fixture
def cache_dir(tmp_path):
    """60 samples of 5..64 tokens; token = sample id * 1000 + position; every other token labelled."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, SEQ + 1, size=60)
    toks, labs, rows, off = [], [], [], 0
    for s, n in enumerate(lengths):
        t = s * 1000 + np.arange(n, dtype=np.int32)
        lab = np.where(np.arange(n) % 2 == 1, t, IGNORE).astype(np.int32)
        lab[0] = t[0] if s % 7 == 0 else IGNORE  # a few samples with a label on their first token
        toks.append(t)
        labs.append(lab)
        rows.append([off, n, int((lab[1:] != IGNORE).sum()), int(lab[0] != IGNORE)])
        off += n
    np.save(tmp_path / "tokens.npy", np.concatenate(toks))
    np.save(tmp_path / "labels.npy", np.concatenate(labs))
    np.save(tmp_path / "index.npy", np.array(rows, dtype=np.int64))
    (tmp_path / "manifest.json").write_text(json.dumps({"pad_id": 7}))
    return tmp_path


def loader(d, **kw):
    args = dict(seq_len=SEQ, micro_batch_size=2, grad_accum=2, dp_size=1, dp_rank=0, seed=1, epochs=2)
    args.update(kw)
    return BatchLoader(d, **args)


def flat(step):
    return [mb["input_ids"] for mb in step.micro_batches]


def test_pack_ffd_respects_capacity_and_is_first_fit_decreasing():
    bins = pack_ffd(np.array([5, 7, 3, 9, 2, 6]), 10)
    assert bins == [[3], [1, 2], [5, 4], [0]]  # 9 | 7+3 | 6+2 | 5
    assert sorted(i for b in bins for i in b) == list(range(6))


def test_packed_rows_respect_boundaries_and_seq_len(cache_dir):
    ld = loader(cache_dir)
    seen = set()
    for step in ld:
        for mb in step.micro_batches:
            assert mb["input_ids"].shape == (2, SEQ) and all(a.dtype == np.int32 for a in mb.values())
            for r in range(2):
                ids, seg, pos = mb["input_ids"][r], mb["segment_ids"][r], mb["position_ids"][r]
                for k in range(1, seg.max() + 1):
                    part = ids[seg == k]
                    sid = part[0] // 1000
                    assert (part == sid * 1000 + np.arange(len(part))).all()  # whole sample, in order
                    assert (pos[seg == k] == np.arange(len(part))).all()  # positions restart
                    seen.add((step.epoch, int(sid)))
                assert (ids[seg == 0] == 7).all() and (mb["labels"][r][seg == 0] == IGNORE).all()
    assert ld.steps_per_epoch == len(ld.units) // 4 and ld.total_steps == 2 * ld.steps_per_epoch
    assert len(seen) > 50


def test_order_is_deterministic_for_a_seed(cache_dir):
    a = [flat(s) for s in loader(cache_dir)]
    b = [flat(s) for s in loader(cache_dir)]
    c = [flat(s) for s in loader(cache_dir, seed=2)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    half = loader(cache_dir).steps_per_epoch
    assert not all(np.array_equal(x, y) for x, y in zip(a[:half], a[half:]))  # reshuffled per epoch


@pytest.mark.parametrize("kw", [{}, {"packing": False}, {"max_tokens_per_batch": 200}])
def test_resume_mid_epoch_gives_the_same_remaining_batches(cache_dir, kw):
    full = [s for s in loader(cache_dir, **kw)]
    first = loader(cache_dir, **kw)
    it = iter(first)
    k = len(full) // 2 + 1  # crosses into the second epoch
    for _ in range(k):
        next(it)
    state = json.loads(json.dumps(first.state_dict()))
    second = loader(cache_dir, **kw)
    second.load_state_dict(state)
    rest = list(second)
    assert len(rest) == len(full) - k
    for x, y in zip(rest, full[k:]):
        assert (x.epoch, x.index, x.global_label_tokens) == (y.epoch, y.index, y.global_label_tokens)
        for m1, m2 in zip(x.micro_batches, y.micro_batches):
            assert all(np.array_equal(m1[key], m2[key]) for key in m1)
    with pytest.raises(ValueError, match="does not match"):
        loader(cache_dir, seed=5, **kw).load_state_dict(state)


@pytest.mark.parametrize("kw", [{}, {"packing": False}])
def test_dp_slices_concatenated_equal_the_dp1_global_batch(cache_dir, kw):
    one = list(loader(cache_dir, micro_batch_size=4, **kw))
    r0 = list(loader(cache_dir, dp_size=2, dp_rank=0, **kw))
    r1 = list(loader(cache_dir, dp_size=2, dp_rank=1, **kw))
    assert len(one) == len(r0) == len(r1) > 0
    for g, a, b in zip(one, r0, r1):
        assert g.global_label_tokens == a.global_label_tokens == b.global_label_tokens
        for mg, ma, mb in zip(g.micro_batches, a.micro_batches, b.micro_batches):
            for key in mg:
                assert np.array_equal(mg[key], np.concatenate([ma[key], mb[key]]))


@pytest.mark.parametrize("kw", [{}, {"packing": False}, {"max_tokens_per_batch": 200}])
def test_global_label_tokens_counts_shifted_labels_of_the_whole_global_batch(cache_dir, kw):
    ranks = [loader(cache_dir, dp_size=2, dp_rank=r, **kw) for r in range(2)]
    for steps in zip(*ranks):
        total = sum(int((mb["labels"][:, 1:] != IGNORE).sum()) for s in steps for mb in s.micro_batches)
        assert all(s.global_label_tokens == total for s in steps)


def test_dynamic_batches_stay_within_the_token_budget(cache_dir):
    ld = loader(cache_dir, max_tokens_per_batch=200)
    shapes = set()
    n = 0
    for step in ld:
        for mb in step.micro_batches:
            rows, width = mb["input_ids"].shape
            assert rows * width <= 200 or rows == 1
            assert (mb["segment_ids"] <= 1).all()
            shapes.add((rows, width))
            n += rows
    assert len(shapes) > 3 and n > 0


def test_bad_arguments(cache_dir):
    with pytest.raises(ValueError, match="dp_rank"):
        loader(cache_dir, dp_size=2, dp_rank=2)
    with pytest.raises(ValueError, match="seq_len=32"):
        loader(cache_dir, seq_len=32)
