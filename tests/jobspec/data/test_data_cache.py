"""Token cache: contents, report, freshness and invalidation, weights, multi-process preparation."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from jobspec.data import cache
from jobspec.data.formats import DataError
from jobspec.data.prepare import ensure_cache, main, prepare
from jobspec.data.template import IGNORE
from tests.jobspec.data.data_helpers import TOKENIZER, alpaca, cache_of, is_fresh, recipe_for, write_json, write_jsonl


@pytest.fixture
def data(tmp_path):
    recs = [alpaca(i) for i in range(20)]
    recs += [alpaca(3),  # duplicate
             alpaca(100, out=" "),  # empty response
             alpaca(101, out="Yes!!!!!!!!!!!!!!!!!!")]  # repeated punctuation
    return write_json(tmp_path / "a.json", recs)


def test_prepare_writes_arrays_index_manifest_and_report(tmp_path, data):
    r = recipe_for(tmp_path, [data])
    info = prepare(*cache_of(r), progress=False)
    d = Path(r.data.cache_dir)
    assert info.dir == d == tmp_path / "out" / "data"
    toks, labs = np.load(d / "tokens.npy", mmap_mode="r"), np.load(d / "labels.npy", mmap_mode="r")
    idx = np.load(d / "index.npy")
    assert toks.dtype == labs.dtype == np.int32 and idx.shape == (20, 4)
    assert int(idx[:, 1].sum()) == len(toks) == info.num_tokens
    start, n = (int(v) for v in idx[5, :2])
    assert toks[start] == 151644 and toks[start + n - 2] == 151645  # <|im_start|> ... <|im_end|>\n
    assert (labs[start + 1:start + n] != IGNORE).sum() == idx[5, 2]
    rep = json.loads((d / "data_report.json").read_text())
    assert rep["samples_read"] == 23 and rep["samples_kept"] == 20
    assert {k: v["count"] for k, v in rep["dropped"].items()} == {"empty_response": 1, "repeated_chars": 1,
                                                                  "dedup": 1}
    assert rep["dropped"]["dedup"]["examples"][0]["where"].endswith("a.json[20]")
    assert 0 < rep["efficiency"]["packing"] <= 1 and rep["token_length"]["max"] <= 128
    m = json.loads((d / "manifest.json").read_text())
    assert m["sources"][0]["sha256"] and m["settings"]["seq_len"] == 128 and m["pad_id"] == 151643
    assert not list(d.parent.glob(".data.*"))  # temp dir renamed away


def test_fresh_then_invalidated_by_input_and_settings(tmp_path, data):
    r = recipe_for(tmp_path, [data])
    assert not is_fresh(r)
    prepare(*cache_of(r), progress=False)
    assert is_fresh(r)
    os.utime(data, (time.time() + 5, time.time() + 5))  # touched, same content: still fresh
    assert is_fresh(r)
    for key, val in (("seq_len", "64"), ("system_prompt", "Be brief."), ("clean.dedup", "false"),
                     ("clean.repeated_chars_max_run", "3"), ("weights", "2")):
        assert not is_fresh(recipe_for(tmp_path, [data], **{key: val})), key
    write_json(data, json.loads(data.read_text()) + [alpaca(50)])
    assert not is_fresh(r)


def test_an_edit_that_keeps_size_and_mtime_is_not_trusted(tmp_path, data):
    """Issue 31: a data file edited with its size and mtime restored (``touch -d``) resumed on the old cache
    silently; its change time moves, so its hash decides: not fresh, and a run's data check names the file."""
    from jobspec.data.runcheck import data_changes

    r = recipe_for(tmp_path, [data])
    prepare(*cache_of(r), progress=False)
    st = data.stat()
    text = data.read_text()
    i = text.index("0")  # one digit of a sample, replaced by another: the same size
    data.write_text(text[:i] + ("1" if text[i] != "1" else "2") + text[i + 1:])
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert data.stat().st_size == st.st_size and data.stat().st_mtime_ns == st.st_mtime_ns
    assert not is_fresh(r)
    changes = data_changes(cache.read_manifest(Path(r.data.cache_dir)), r.data, TOKENIZER)
    assert changes == [f"{data.resolve()} changed since the run read it (same size, other contents)"]


def test_weights_repeat_and_subsample(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [alpaca(i) for i in range(10)])
    b = write_jsonl(tmp_path / "b.jsonl", [alpaca(100 + i) for i in range(10)])
    info = prepare(*cache_of(recipe_for(tmp_path, [a, b], weights="2,0.5")), progress=False)
    idx = np.load(info.dir / "index.npy")
    assert info.num_samples == len(idx) == 25
    assert len(np.unique(idx[:, 0])) == 15  # copies share tokens: 10 of a + 5 of b


def test_invalid_utf8_line_counted_not_fatal(tmp_path):
    p = tmp_path / "raw.jsonl"
    good = [json.dumps(alpaca(i)).encode() for i in range(3)]
    p.write_bytes(b"\n".join(good + [b'{"instruction": "caf\xe9?", "output": "ok ok ok"}']) + b"\n")
    info = prepare(*cache_of(recipe_for(tmp_path, [p])), progress=False)
    assert info.num_samples == 3
    assert info.report["dropped"]["invalid_utf8"]["examples"][0]["where"].endswith("raw.jsonl:line 4")


def test_everything_dropped_is_a_clear_error(tmp_path):
    p = write_json(tmp_path / "e.json", [alpaca(0, out=""), alpaca(1, out="  ")])
    with pytest.raises(DataError, match="empty data set.*e.json.*empty_response"):
        prepare(*cache_of(recipe_for(tmp_path, [p])), progress=False)
    assert not (tmp_path / "out" / "data").exists()


def test_main_prints_table_and_reuses_fresh_cache(tmp_path, data, capsys):
    r = recipe_for(tmp_path, [data])
    assert main(r) == 0
    out = capsys.readouterr().out
    assert "repeated_chars" in out and "kept" in out and "packing" in out
    assert main(r) == 0 and "up to date" in capsys.readouterr().out
    bad = recipe_for(tmp_path, [tmp_path / "missing.json"])
    assert main(bad) == 2 and "missing.json" in capsys.readouterr().err


def test_worker_processes_give_the_same_cache(tmp_path, data):
    one = prepare(*cache_of(recipe_for(tmp_path / "1", [data])), progress=False)
    two = prepare(*cache_of(recipe_for(tmp_path / "2", [data], num_workers="2")), progress=False)
    for name in ("tokens.npy", "labels.npy", "index.npy"):
        assert np.array_equal(np.load(one.dir / name), np.load(two.dir / name)), name


def test_ensure_cache_only_the_preparer_tokenizes(tmp_path, data):
    shared = recipe_for(tmp_path, [data], shared_storage="true")
    with pytest.raises(TimeoutError, match="global rank 0"):  # rank 1 never prepares; it waits
        ensure_cache(*cache_of(shared), rank=1, local_rank=0, timeout_s=0.2, poll_s=0.05)
    assert not (tmp_path / "out" / "data").exists()
    info = ensure_cache(*cache_of(shared), rank=0, local_rank=0)
    assert ensure_cache(*cache_of(shared), rank=1, local_rank=0, timeout_s=1).num_samples == info.num_samples
    per_node = recipe_for(tmp_path, [data], seq_len="96")
    with pytest.raises(TimeoutError, match="local rank 0 of this node"):
        ensure_cache(*cache_of(per_node), rank=0, local_rank=1, timeout_s=0.1, poll_s=0.05)


def test_a_waiting_rank_hashes_the_tokenizer_once_not_per_poll(tmp_path, data, monkeypatch):
    """Issue 32 item 3: the cache settings (with the tokenizer's sha256) are computed once per wait, while a
    stale cache (another seq_len) is there to compare with."""
    prepare(*cache_of(recipe_for(tmp_path, [data], seq_len="96")), progress=False)
    hashed = []
    real = cache.file_hash
    monkeypatch.setattr(cache, "file_hash", lambda path: (hashed.append(Path(path)), real(path))[1])
    with pytest.raises(TimeoutError):
        ensure_cache(*cache_of(recipe_for(tmp_path, [data])), rank=1, local_rank=1, timeout_s=0.3, poll_s=0.02)
    assert hashed.count(TOKENIZER) == 1
