"""Readers for instruction data: Alpaca and ShareGPT records in JSON, JSONL or Parquet.

Every record becomes a :class:`Sample` (system prompt or None, then (role, content) turns with
roles "user"/"assistant"). Bad input raises :class:`DataError` naming the file, the record
(line for JSONL, index for JSON/Parquet), the field and the fix.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from finetune.config import REPO_ROOT, DataConfig

EXTENSIONS = (".json", ".jsonl", ".parquet")
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
          "system": "system"}
_SURROGATE = re.compile("[\udc80-\udcff]")


class DataError(ValueError):
    """A data file problem; the message names the file, the record, the field and the fix."""


class Sample(NamedTuple):
    system: str | None  # None: use data.system_prompt
    turns: tuple[tuple[str, str], ...]  # ("user"|"assistant", content) in order
    where: str  # "file.jsonl:line 7" or "file.json[3]"
    bad_utf8: bool = False  # the raw bytes were not valid UTF-8 (replaced by U+FFFD)


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


def resolve_sources(cfg: DataConfig) -> list[Source]:
    """data.paths (files or directories) + data.weights -> the files to read, in order."""
    if not cfg.paths:
        raise DataError("data.paths is empty: give the data files or a directory "
                        "(e.g. DATA=assets/data or data.paths=train.jsonl)")
    weights = cfg.weights or [1.0] * len(cfg.paths)
    out: list[Source] = []
    for i, (p, w) in enumerate(zip(cfg.paths, weights)):
        if w < 0:
            raise DataError(f"data.weights[{i}]={w}: a weight is >= 0 (e.g. data.weights=1,0.5)")
        path = resolve_path(p)
        if path.is_dir():
            files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in EXTENSIONS
                           and not any(part.startswith(".") for part in f.relative_to(path).parts))
            if not files:
                raise DataError(f"{path}: directory holds no {'/'.join(EXTENSIONS)} files "
                                f"(data.paths[{i}]); put the data there or name the files")
            out += [Source(f, float(w)) for f in files]
        elif path.is_file():
            if path.suffix not in EXTENSIONS:
                raise DataError(f"{path}: unknown file format {path.suffix or '(no extension)'!r}; "
                                f"use .json (array), .jsonl (one record per line) or .parquet")
            out.append(Source(path, float(w)))
        else:
            raise DataError(f"{p}: no such file or directory (data.paths[{i}]; relative paths are "
                            f"looked up in {os.getcwd()} and {REPO_ROOT})")
    return out


# ------------------------------------------------------------------------------ raw records

def _decode(raw: bytes) -> tuple[str, bool]:
    """Bytes -> text; invalid UTF-8 is kept as surrogate escapes and flagged."""
    try:
        return raw.decode("utf-8"), False
    except UnicodeDecodeError:
        return raw.decode("utf-8", "surrogateescape"), True


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


def iter_raw(path: Path) -> Iterator[tuple[str, Any, bool]]:
    """Yield (where, record, bad_utf8) for every record of one file."""
    name = str(path)
    if path.suffix == ".parquet":
        yield from _iter_parquet(path)
        return
    if path.stat().st_size == 0:
        raise DataError(f"{name}: empty file; remove it from data.paths or add records")
    if path.suffix == ".json":
        text, bad = _decode(path.read_bytes())
        head = text.lstrip()[:1]
        if head == "[":
            try:
                records = json.loads(text)
            except json.JSONDecodeError as e:
                raise _json_error(path, text, e) from None
            for i, rec in enumerate(records):
                yield f"{name}[{i}]", rec, bad and _has_surrogates(rec)
            return
        if head != "{":
            raise DataError(f"{name}: record 0: not a JSON array or object (starts with {head!r}); "
                            "a .json file holds [ {...}, ... ] (or use .jsonl: one object per line)")
    with open(path, "rb") as f:  # JSONL (or a .json file with one object per line)
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            line, bad = _decode(raw)
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{name}: line {n} (column {e.colno}): not valid JSON: {e.msg}; "
                                "each line must be one complete JSON object") from None
            yield f"{name}:line {n}", rec, bad


def _has_surrogates(obj: Any) -> bool:
    if isinstance(obj, str):
        return bool(_SURROGATE.search(obj))
    if isinstance(obj, dict):
        return any(_has_surrogates(v) for v in obj.values())
    if isinstance(obj, list):
        return any(_has_surrogates(v) for v in obj)
    return False


def _iter_parquet(path: Path) -> Iterator[tuple[str, Any, bool]]:
    import pyarrow.parquet as pq  # only needed for Parquet input

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise DataError(f"{path}: not a readable Parquet file ({e}); re-export it or use JSON/JSONL") from None
    names = set(pf.schema_arrow.names)
    if not ({"instruction", "output"} <= names or names & {"conversations", "messages"}):
        raise DataError(f"{path}: Parquet columns {sorted(names)} lack the needed ones: Alpaca needs "
                        "'instruction' and 'output' (optional 'input', 'system', 'history'); ShareGPT needs "
                        "'conversations' or 'messages'; rename the columns")
    i = 0
    for batch in pf.iter_batches(batch_size=2048):
        for rec in batch.to_pylist():
            yield f"{path}[{i}]", rec, False
            i += 1


# ------------------------------------------------------------------------------ records -> samples

def detect_kind(rec: Any, where: str) -> str:
    """'alpaca' or 'sharegpt' from one record's keys."""
    if isinstance(rec, dict):
        if "conversations" in rec or "messages" in rec:
            return "sharegpt"
        if "instruction" in rec or "output" in rec:
            return "alpaca"
        keys = sorted(rec)[:8]
    else:
        keys = type(rec).__name__
    raise DataError(f"{where}: unknown format (record has {keys}); expected Alpaca "
                    "(instruction/input/output) or ShareGPT (conversations or messages); "
                    "fix the record or set data.format=alpaca|sharegpt")


def _text(rec: dict, key: str, where: str, required: bool, example: str) -> str:
    v = rec.get(key)
    if v is None:
        if required:
            raise DataError(f"{where}: field {key!r} is missing; add it (e.g. \"{key}\": \"{example}\")")
        return ""
    if not isinstance(v, str):
        raise DataError(f"{where}: field {key!r} must be a string, got {type(v).__name__} "
                        f"({str(v)[:40]!r}); e.g. \"{key}\": \"{example}\"")
    return v


def alpaca_sample(rec: Any, where: str, bad: bool = False) -> Sample:
    """instruction (+ "\\n" + input), output, optional system and history [[user, assistant], ...]."""
    if not isinstance(rec, dict):
        raise DataError(f"{where}: an Alpaca record is an object with instruction/input/output, "
                        f"got {type(rec).__name__}")
    instr = _text(rec, "instruction", where, True, "Summarize the text.")
    inp = _text(rec, "input", where, False, "")
    out = _text(rec, "output", where, True, "The answer.")
    system = rec.get("system")
    if system is not None:
        system = _text(rec, "system", where, False, "You are a helpful assistant.") or None
    turns: list[tuple[str, str]] = []
    history = rec.get("history") or []
    if not isinstance(history, list):
        raise DataError(f"{where}: field 'history' must be a list of [user, assistant] pairs, "
                        f"got {type(history).__name__}")
    for j, pair in enumerate(history):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise DataError(f"{where}: field 'history[{j}]' must be a [user, assistant] pair of strings, "
                            f"got {str(pair)[:60]!r}")
        turns += [("user", pair[0]), ("assistant", pair[1])]
    turns += [("user", f"{instr}\n{inp}" if inp else instr), ("assistant", out)]
    return Sample(system, tuple(turns), where, bad)


def sharegpt_sample(rec: Any, where: str, bad: bool = False) -> Sample:
    """conversations [{from, value}] or messages [{role, content}] (+ optional top-level system)."""
    if not isinstance(rec, dict):
        raise DataError(f"{where}: a ShareGPT record is an object with 'conversations' or 'messages', "
                        f"got {type(rec).__name__}")
    key, rk, ck = ("conversations", "from", "value") if "conversations" in rec else ("messages", "role", "content")
    msgs = rec.get(key)
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: field {key!r} must be a non-empty list of {{\"{rk}\": ..., \"{ck}\": ...}}, "
                        f"got {str(msgs)[:60]!r}")
    system = rec.get("system")
    if system is not None:
        system = _text(rec, "system", where, False, "You are a helpful assistant.") or None
    turns: list[tuple[str, str]] = []
    for j, m in enumerate(msgs):
        field = f"{key}[{j}]"
        if not isinstance(m, dict):
            raise DataError(f"{where}: field {field!r} must be an object with {rk!r} and {ck!r}")
        role = _ROLES.get(str(m.get(rk)).lower()) if m.get(rk) is not None else None
        if role is None:
            raise DataError(f"{where}: field '{field}.{rk}' = {m.get(rk)!r} is not a known role; use one of "
                            f"{', '.join(_ROLES)}")
        content = _text(m, ck, f"{where} {field}", True, "text")
        if role == "system":
            if turns:
                raise DataError(f"{where}: field '{field}': a system message must come first; move it")
            system = content or None
            continue
        turns.append((role, content))
    while turns and turns[-1][0] == "user":  # nothing to learn after the last answer
        turns.pop()
    return Sample(system, tuple(turns), where, bad)


def iter_samples(path: Path, fmt: str = "auto", limit: int = 0) -> Iterator[Sample]:
    """Samples of one file; fmt 'auto' detects Alpaca/ShareGPT from the first record."""
    kind = None if fmt == "auto" else fmt
    n = 0
    for where, rec, bad in iter_raw(path):
        if kind is None:
            kind = detect_kind(rec, where)
        s = alpaca_sample(rec, where, bad) if kind == "alpaca" else sharegpt_sample(rec, where, bad)
        if bad:
            s = s._replace(system=_fix(s.system), turns=tuple((r, _fix(c)) for r, c in s.turns))
        yield s
        n += 1
        if limit and n >= limit:
            return
    if n == 0:
        raise DataError(f"{path}: no records (empty data set); add records or remove it from data.paths")


def _fix(s: str | None) -> str | None:
    """Surrogate-escaped invalid bytes -> U+FFFD."""
    if s is None or not _SURROGATE.search(s):
        return s
    return s.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def check_data(data_cfg: DataConfig, max_records: int = 3) -> list[str]:
    """Open every data path, parse up to max_records per file; problems (file, record, field, fix)."""
    try:
        sources = resolve_sources(data_cfg)
    except DataError as e:
        return [str(e)]
    problems = []
    for src in sources:
        try:
            for _ in iter_samples(src.path, data_cfg.format, limit=max_records):
                pass
        except DataError as e:
            problems.append(str(e))
        except ImportError as e:
            problems.append(f"{src.path}: cannot read Parquet ({e}); install pyarrow<22 (make setup)")
    return problems
