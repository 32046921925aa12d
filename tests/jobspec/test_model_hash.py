"""The base model's identity (jobspec/checkpoint_index.model_hash): every weight file read in full once, then
remembered by (path, size, mtime_ns) so that a rerun reads nothing unchanged; an edit is read again."""
from __future__ import annotations

import json
import os

import pytest

from jobspec import checkpoint_index
from jobspec.checkpoint_index import model_hash


@pytest.fixture
def reads(monkeypatch):
    """The files model_hash reads in full, in order."""
    seen = []
    real = checkpoint_index.file_hash
    monkeypatch.setattr(checkpoint_index, "file_hash", lambda path: (seen.append(path.name), real(path))[1])
    return seen


def _model(root):
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 8}))
    for i in (1, 2):
        (root / f"model-0000{i}-of-00002.safetensors").write_bytes(bytes([i]) * 4096)
    return root


def test_a_rerun_reads_no_unchanged_weight_file_and_an_edit_is_read_again(tmp_path, reads):
    model, cache = _model(tmp_path / "m"), tmp_path / "out" / ".model-hashes.json"
    cache.parent.mkdir()
    first = model_hash(model, cache)
    assert sorted(reads) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert model_hash(model, cache) == first and len(reads) == 2  # the cache: nothing read again
    assert model_hash(model) == first and len(reads) == 4  # without it: the same identity, read in full

    w = model / "model-00002-of-00002.safetensors"
    st = w.stat()
    data = bytearray(w.read_bytes())
    data[2000] ^= 0xFF  # same size, another mtime: the file is read again and the identity differs
    w.write_bytes(bytes(data))
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    edited = model_hash(model, cache)
    assert edited != first and reads[4:] == ["model-00002-of-00002.safetensors"]
    assert model_hash(model, cache) == edited and len(reads) == 5
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000))  # touched only: read again, same identity
    assert model_hash(model, cache) == edited and len(reads) == 6
    assert len(json.loads(cache.read_text())) == 2  # only the current files' entries are kept


def test_a_damaged_cache_is_ignored_and_rewritten(tmp_path, reads):
    model, cache = _model(tmp_path / "m"), tmp_path / "hashes.json"
    want = model_hash(model)
    for junk in ("{not json", "[1, 2]", json.dumps({"x": 1})):
        cache.write_text(junk)
        assert model_hash(model, cache) == want
    assert isinstance(json.loads(cache.read_text()), dict) and model_hash(model, cache) == want


def test_a_big_model_says_that_it_is_hashed_once(tmp_path, monkeypatch):
    model = _model(tmp_path / "m")
    with open(model / "model-00001-of-00002.safetensors", "r+b") as f:
        f.truncate(3 << 30)  # sparse: 3 GiB on paper
    monkeypatch.setattr(checkpoint_index, "file_hash", lambda path: "0" * 64)  # not read here
    said: list[str] = []
    cache = tmp_path / "hashes.json"
    model_hash(model, cache, log=said.append)
    assert len(said) == 1 and "hashing the 2 weight file(s)" in said[0] and "(3.0 GiB)" in said[0]
    assert str(cache) in said[0]
    model_hash(model, cache, log=said.append)
    assert len(said) == 1  # remembered: no line, nothing read
