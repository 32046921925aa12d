"""The token cache: flat int32 token/label arrays (.npy, memory-mapped), an index and a manifest.

Layout of ``data.cache_dir`` (default ``<output_dir>/data``)::

    tokens.npy   int32 [T]      all kept samples' input_ids, back to back
    labels.npy   int32 [T]      aligned labels (-100 = none)
    index.npy    int64 [N, 4]   start, length, shifted label count (labels[1:] != -100), labels[0] != -100
    val_index.npy int64 [V, 4]  the same for the validation set (data.val_size / data.val_paths), if any
    manifest.json               fingerprint: sources (size, mtime, change time, sha256), tokenizer hash, settings
    data_report.json            kept/dropped per rule, token-length percentiles, packing efficiency

A sample of a file with weight 2 has two index rows pointing at the same tokens. This module only
stores and checks: ``jobspec/data/prepare.py`` builds the cache (in a temp sibling directory
renamed into place, ``jobspec/fsutil.atomic_dir``) and decides which process prepares it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from jobspec.config import DataConfig
from jobspec.data.files import Source, resolve_sources
from jobspec.data.template import TEMPLATE_VERSIONS, chat_format
from jobspec.fsutil import file_hash
from jobspec.keys import cache_settings

MANIFEST = "manifest.json"
INDEX = "index.npy"
VAL_INDEX = "val_index.npy"
FORMAT_VERSION = 1
_HEADER = 128  # fixed .npy header size so arrays can be streamed and the shape filled in last


@dataclass
class CacheInfo:
    """A ready cache: where it is and what is in it."""

    dir: Path
    num_samples: int  # index rows (after weights)
    num_tokens: int  # tokens stored (unique samples)
    manifest: dict[str, Any]
    report: dict[str, Any]
    num_val: int = 0  # validation samples (val_index.npy)


def settings_of(d: DataConfig, tokenizer_path: str | Path) -> dict[str, Any]:
    """Every setting that changes the cache's content: the keys whose facts say so (jobspec/keys.py; batching
    settings do not), the template and the tokenizer. It hashes the tokenizer: once per wait, not per poll."""
    return {"format_version": FORMAT_VERSION, "template": TEMPLATE_VERSIONS[chat_format(tokenizer_path)],
            "tokenizer_sha256": file_hash(Path(tokenizer_path)), **cache_settings(d)}


def source_entry(src: Source, with_hash: bool = True) -> dict[str, Any]:
    st = src.path.stat()
    e = {"path": str(src.path.resolve()), "weight": src.weight, "size": st.st_size, "mtime": st.st_mtime,
         "ctime_ns": st.st_ctime_ns}
    if with_hash:
        e["sha256"] = file_hash(src.path)
    return e


def read_manifest(cache_dir: Path) -> dict[str, Any] | None:
    try:
        manifest: dict[str, Any] = json.loads((Path(cache_dir) / MANIFEST).read_text())
        return manifest
    except (OSError, json.JSONDecodeError):
        return None


def cache_is_fresh(data: DataConfig, cache_dir: Path, settings: dict[str, Any]) -> bool:
    """True when the cache in ``cache_dir`` exists and matches ``data``'s inputs and ``settings``
    (:func:`settings_of`).

    A source whose size, mtime and change time are unchanged is trusted (:func:`same_stat`); otherwise its hash
    decides.
    """
    m = read_manifest(cache_dir)
    if not m or m.get("settings") != settings:
        return False
    try:
        sources = resolve_sources(data) + resolve_sources(data, val=True)
    except ValueError:
        return False
    old = m.get("sources", [])
    if len(old) != len(sources):
        return False
    for src, o in zip(sources, old):
        now = source_entry(src, with_hash=False)
        if (now["path"], now["weight"], now["size"]) != (o["path"], o["weight"], o["size"]):
            return False
        if not same_stat(o, now) and file_hash(src.path) != o["sha256"]:
            return False
    return True


def same_stat(old: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether a source's file is untouched since its manifest ``old`` entry: the same mtime and inode change
    time. A content edit that restores the size and mtime (``touch -d``, ``cp -p``) still moves the change time,
    which no user can set, so its hash decides; a manifest without it (older versions) is hashed again."""
    return bool(old.get("mtime") == now["mtime"] and old.get("ctime_ns") == now["ctime_ns"])


def load_info(cache_dir: Path) -> CacheInfo:
    m = read_manifest(cache_dir) or {}
    try:
        report = json.loads((Path(cache_dir) / "data_report.json").read_text())
    except (OSError, json.JSONDecodeError):
        report = {}
    return CacheInfo(Path(cache_dir), int(m.get("num_samples", 0)), int(m.get("num_tokens", 0)), m, report,
                     int(m.get("num_val_samples", 0)))


# ------------------------------------------------------------------------------ streamed writing

def _npy_header(dtype: np.dtype[Any], shape: tuple[int, ...]) -> bytes:
    d = f"{{'descr': '{np.dtype(dtype).str}', 'fortran_order': False, 'shape': {shape!r}, }}"
    body = d.encode("latin1")
    pad = _HEADER - 10 - len(body) - 1
    return b"\x93NUMPY\x01\x00" + (_HEADER - 10).to_bytes(2, "little") + body + b" " * pad + b"\n"


class ArrayStream:
    """Append-only .npy file of one dtype whose shape is written on close."""

    def __init__(self, path: Path, dtype: Any, row_shape: tuple[int, ...] = ()):
        self.path, self.dtype, self.row_shape, self.rows = path, np.dtype(dtype), row_shape, 0
        self.f = open(path, "wb")
        self.f.write(b"\0" * _HEADER)

    def write(self, arr: NDArray[Any]) -> None:
        a = np.ascontiguousarray(arr, dtype=self.dtype)
        self.f.write(a.tobytes())
        self.rows += a.shape[0] if a.ndim else 1

    def close(self) -> None:
        self.f.seek(0)
        self.f.write(_npy_header(self.dtype, (self.rows, *self.row_shape)))
        self.f.close()
