"""Data files: which files to read (data.paths, data.val_paths) and their raw records.

JSON (an array, or one object per line), JSONL, Parquet and plain-text ``.txt`` files. Bad input
raises :class:`DataError` naming the file, the record (line for JSONL, index for JSON/Parquet),
the field and the fix.
"""
from __future__ import annotations

import codecs
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobspec.config import REPO_ROOT, DataConfig

EXTENSIONS = (".json", ".jsonl", ".parquet", ".txt")
# Hugging Face datasets' metadata files (hub snapshots, save_to_disk): never records
METADATA = frozenset({"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"})
TRAIN = re.compile(r"train(?:[-_.].*)?", re.IGNORECASE)  # split file names: train-00000-of-00001.parquet
HELD_OUT = re.compile(r"(?:test|validation|valid|val|eval|dev)(?:[-_.].*)?", re.IGNORECASE)
SURROGATE = re.compile("[\udc80-\udcff]")
UTF16_BOMS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)


class DataError(ValueError):
    """A data file problem; the message names the file, the record, the field and the fix."""


@dataclass(frozen=True)
class Source:
    """One data file and how often its samples are taken."""

    path: Path
    weight: float = 1.0


def resolve_path(p: str) -> Path:
    """A relative path resolves against the current directory, then the repo root."""
    path = Path(p).expanduser()
    if path.is_absolute() or path.exists():
        return path
    alt = REPO_ROOT / path
    return alt if alt.exists() else path


def resolve_sources(cfg: DataConfig, val: bool = False) -> list[Source]:
    """data.paths (files or directories) + data.weights -> the files to read, in order; with ``val``
    the files of data.val_paths (weight 1; none when unset). A directory's .txt files are read
    when it holds no other data files or data.format is text."""
    paths, key = (cfg.val_paths, "data.val_paths") if val else (cfg.paths, "data.paths")
    if not paths and not val:
        raise DataError("data.paths is empty: give the data files or a directory "
                        "(e.g. DATA=assets/data or data.paths=train.jsonl)")
    weights = ([] if val else cfg.weights) or [1.0] * len(paths)
    out: list[Source] = []
    for i, (p, w) in enumerate(zip(paths, weights)):
        if w < 0:
            raise DataError(f"data.weights[{i}]={w}: a weight is >= 0 (e.g. data.weights=1,0.5)")
        path = resolve_path(p)
        if path.is_dir():
            files = _data_files(path, f"{key}[{i}]")
            if cfg.format != "text" and any(f.suffix != ".txt" for f in files):  # a README.txt beside data
                files = [f for f in files if f.suffix != ".txt"]
            if not files:
                raise DataError(f"{path}: directory holds no {'/'.join(EXTENSIONS)} files "
                                f"({key}[{i}]); put the data there or name the files")
            out += [Source(f, float(w)) for f in files]
        elif path.is_file():
            if path.suffix not in EXTENSIONS:
                raise DataError(f"{path}: unknown file format {path.suffix or '(no extension)'!r}; "
                                f"use .json (array), .jsonl (one record per line), .parquet or .txt (plain text)")
            out.append(Source(path, float(w)))
        else:
            raise DataError(f"{p}: no such file or directory ({key}[{i}]; relative paths are "
                            f"looked up in {os.getcwd()} and {REPO_ROOT})")
    return out


def _data_files(d: Path, where: str) -> list[Path]:
    """The data files under a directory: hidden entries and a Hugging Face dataset's metadata (a hub snapshot:
    README.md, dataset_info.json beside data/*.parquet) are skipped; a link that leads nowhere is refused."""
    files = []
    for f in d.rglob("*"):
        if f.suffix not in EXTENSIONS or f.name in METADATA or any(p.startswith(".") for p in f.relative_to(d).parts):
            continue
        if f.is_symlink() and not f.exists():
            raise DataError(f"{f}: a broken symlink or a symlink loop ({where}); fix the link, or remove it")
        if f.is_file():
            files.append(f)
    held_out = [f for f in files if HELD_OUT.fullmatch(f.stem)]
    train = [f for f in files if TRAIN.fullmatch(f.stem)]
    if held_out and train:  # a hub snapshot's splits: its test split is not training data
        raise DataError(f"{d}: holds a train split ({train[0].name}) and held-out splits "
                        f"({', '.join(f.name for f in held_out[:3])}) ({where}); name the train files (e.g. "
                        f"DATA={','.join(map(str, train[:2]))}), and the held-out ones as data.val_paths if wanted")
    return sorted(files)


# ------------------------------------------------------------------------------ raw records

def decode(raw: bytes) -> tuple[str, bool]:
    """Bytes -> text: UTF-8 (a leading BOM dropped, as Windows editors write it), or UTF-16 when it starts with
    a UTF-16 BOM; invalid bytes are kept as surrogate escapes (UTF-16: U+FFFD) and flagged."""
    if raw[:2] in UTF16_BOMS:
        try:
            return raw.decode("utf-16"), False
        except UnicodeDecodeError:
            return raw.decode("utf-16", "replace"), True
    raw = raw.removeprefix(codecs.BOM_UTF8)
    try:
        return raw.decode("utf-8"), False
    except UnicodeDecodeError:
        return raw.decode("utf-8", "surrogateescape"), True


def _lines(path: Path) -> Iterator[tuple[int, str, bool]]:
    """(line number, text, bad encoding) of each line (a UTF-16 file is decoded whole: its newlines are 2 bytes)."""
    with open(path, "rb") as f:
        utf16 = f.read(2) in UTF16_BOMS
        f.seek(0)
        if utf16:
            text, bad = decode(f.read())
            yield from ((n, line, bad) for n, line in enumerate(text.splitlines(), 1))
            return
        for n, raw in enumerate(f, 1):
            yield (n, *decode(raw))


def _json_error(path: Path, text: str, err: json.JSONDecodeError) -> DataError:
    """Locate the failing record of a JSON array for the message."""
    dec = json.JSONDecoder()
    idx, pos = 0, text.index("[") + 1
    try:
        while True:
            while pos < len(text) and text[pos] in " \t\r\n,":
                pos += 1
            if pos >= len(text) or text[pos] == "]":
                break
            _, pos = dec.raw_decode(text, pos)
            idx += 1
    except json.JSONDecodeError:
        pass
    hint = ("the file ends before the array is closed (truncated?); restore the full file"
            if not text.rstrip().endswith("]") else "fix the JSON syntax there")
    return DataError(f"{path}: record {idx} (line {err.lineno}, column {err.colno}): not valid JSON: "
                     f"{err.msg}; {hint}")


def _json_head(path: Path, text: str, limit: int) -> list[Any]:
    """The first ``limit`` records of a JSON array without parsing the rest (quick checks)."""
    dec, out, pos = json.JSONDecoder(), list[Any](), text.index("[") + 1
    while len(out) < limit:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            rec, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise _json_error(path, text, e) from None
        out.append(rec)
    return out


def iter_raw(path: Path, limit: int = 0, skip: bool = False) -> Iterator[tuple[str, Any, bool]]:
    """Yield (where, record, bad_utf8) for every record of one file (a JSON array: the first
    ``limit`` records only, when limit > 0). With ``skip`` a JSONL line that is not valid JSON is
    yielded as its DataError instead of raised."""
    name = str(path)
    if path.suffix == ".parquet":
        yield from _iter_parquet(path)
        return
    if path.stat().st_size == 0:
        raise DataError(f"{name}: empty file; remove it from data.paths or add records")
    if path.suffix == ".json":
        text, bad = decode(path.read_bytes())
        head = text.lstrip()[:1]
        if head == "[":
            try:
                records = _json_head(path, text, limit) if limit else json.loads(text)
            except json.JSONDecodeError as e:
                raise _json_error(path, text, e) from None
            for i, rec in enumerate(records):
                yield f"{name}[{i}]", rec, bad and _has_surrogates(rec)
            return
        if head != "{":
            raise DataError(f"{name}: record 0: not a JSON array or object (starts with {head!r}); "
                            "a .json file holds [ {...}, ... ] (or use .jsonl: one object per line)")
    for n, line, bad in _lines(path):  # JSONL (or a .json file with one object per line)
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            rec = _line_error(path, n, e)
            if not skip:
                raise rec from None
        yield f"{name}:line {n}", rec, bad


def _line_error(path: Path, n: int, err: json.JSONDecodeError) -> DataError:
    """Line ``n`` of a one-object-per-line file is not JSON. A .json file whose first object spans several
    lines is read as one document instead, so the error points where its JSON really breaks."""
    at = f"{path}: line {n} (column {err.colno}): not valid JSON: {err.msg}"
    if path.suffix != ".json":
        return DataError(f"{at}; each line of a .jsonl file must be one complete JSON object")
    fix = "a .json file holds an array [ {...}, {...} ] or one complete object per line"
    try:
        json.loads(decode(path.read_bytes())[0])
    except json.JSONDecodeError as e:
        if e.msg != "Extra data":  # else the first object is whole: the line's own error is the one
            at = f"{path}: line {e.lineno} (column {e.colno}): not valid JSON: {e.msg}"
        return DataError(f"{at}; {fix}")
    return DataError(f"{path}: one JSON object over several lines, not a list of records; {fix}")


def _has_surrogates(obj: Any) -> bool:
    if isinstance(obj, str):
        return bool(SURROGATE.search(obj))
    if isinstance(obj, dict):
        return any(_has_surrogates(v) for v in obj.values())
    if isinstance(obj, list):
        return any(_has_surrogates(v) for v in obj)
    return False


def _iter_parquet(path: Path) -> Iterator[tuple[str, Any, bool]]:
    try:
        import pyarrow.parquet as pq  # only needed for Parquet input
    except ImportError as e:
        raise DataError(f"{path}: cannot read Parquet here ({e}); install pyarrow<22 (make setup) "
                        "or convert the file to JSONL") from None

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise DataError(f"{path}: not a readable Parquet file ({e}); re-export it or use JSON/JSONL") from None
    i = 0
    for batch in pf.iter_batches(batch_size=2048):
        for rec in batch.to_pylist():
            yield f"{path}[{i}]", rec, False
            i += 1
