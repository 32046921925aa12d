"""Records -> samples: Alpaca, ShareGPT (with tool calls) and plain text, detected per file.

Every record becomes a :class:`Sample` (system prompt or None, tool schemas or None, then
(role, content) turns with roles "user"/"assistant", already in the Qwen2.5 tool-call form; a
plain-text document is one ("text", document) turn). Bad input raises :class:`DataError` naming
the file, the record, the field and the fix.
"""
from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple, overload

from jobspec.config import DataConfig
from jobspec.data.files import SURROGATE, DataError, decode, iter_raw, resolve_sources

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
          "function_call": "function_call", "observation": "tool", "tool": "tool", "function": "tool"}


class Sample(NamedTuple):
    system: str | None  # None: use data.system_prompt
    turns: tuple[tuple[str, str], ...]  # ("user"|"assistant", content) in order; text: (("text", document),)
    where: str  # "file.jsonl:line 7" or "file.json[3]"
    bad_utf8: bool = False  # the raw bytes were not valid UTF-8 (replaced by U+FFFD)
    tools: str | None = None  # tool schemas, one JSON object per line (the system block's <tools>)
    dropped_tail: int = 0  # user / tool turns after the last answer, dropped


def is_text(s: Sample) -> bool:
    """A plain-text document (loss on every token) rather than a conversation."""
    return bool(s.turns) and s.turns[0][0] == "text"


def uses_tools(s: Sample) -> bool:
    """A conversation with tool schemas, tool calls or tool results."""
    return s.tools is not None or any("<tool_call>" in c or "<tool_response>" in c for _, c in s.turns)


# field names of other datasets -> the format field they usually mean (for the data.columns hint)
_ALIASES = {"prompt": "instruction", "question": "instruction", "query": "instruction", "completion": "output",
            "answer": "output", "response": "output", "chosen": "output", "dialog": "conversations",
            "conversation": "conversations", "chat": "messages", "content": "text", "document": "text"}
_NAMES = {"alpaca": "Alpaca", "sharegpt": "ShareGPT", "text": "plain text"}


def _columns_hint(rec: dict[str, Any]) -> str:
    """'; map your field names, e.g. data.columns=...' when the record's keys suggest a mapping."""
    guess = {_ALIASES[k]: k for k in rec if k in _ALIASES}
    return (f"; or map your field names: data.columns='{json.dumps(guess)}'" if guess else
            "; or map your field names with data.columns (e.g. data.columns='{\"instruction\": \"question\", "
            "\"output\": \"answer\"}')")


def detect_kind(rec: Any, where: str) -> tuple[str, str]:
    """(format, reason) from one record's keys: 'sharegpt', 'alpaca' or 'text'."""
    if isinstance(rec, dict):
        for key in ("conversations", "messages"):
            if key in rec:
                return "sharegpt", f"records have `{key}`"
        for key in ("instruction", "output"):
            if key in rec:
                return "alpaca", f"records have `{key}`"
        if "text" in rec:
            return "text", "records have `text`"
        keys: list[Any] | str = sorted(rec)[:8]
    else:
        keys = type(rec).__name__
    raise DataError(f"{where}: unknown format (record has {keys}); expected Alpaca (instruction/input/output), "
                    "ShareGPT (conversations or messages) or plain text (text)"
                    + (_columns_hint(rec) if isinstance(rec, dict) else "; fix the record"))


def _mapped(rec: Any, columns: dict[str, str]) -> Any:
    """The record with data.columns applied (its own fields copied under the format's names)."""
    if not columns or not isinstance(rec, dict):
        return rec
    return {**rec, **{canon: rec[own] for canon, own in columns.items() if own in rec}}


def file_format(path: Path, fmt: str = "auto", columns: dict[str, str] | None = None) -> tuple[str, str]:
    """(format, why) of one file: a .txt file is text; otherwise the first record decides (auto), or
    confirms the format that is set (a file that plainly is another format is an error naming it)."""
    if path.suffix == ".txt":
        if fmt not in ("auto", "text"):
            raise DataError(f"{path}: a .txt file is plain text, but data.format is {fmt}; set DATA_FORMAT=text "
                            "(or auto), or give this file its own data set")
        return "text", "a .txt file"
    first = next(iter_raw(path, limit=1, skip=False), None)
    if first is None:
        raise DataError(f"{path}: no records (empty data set); add records or remove it from data.paths")
    where, rec, _ = first
    rec = _mapped(rec, columns or {})
    if fmt == "auto":
        kind, why = detect_kind(rec, where)
        return kind, f"{why}; detected, DATA_FORMAT sets it"
    needs = {"alpaca": ("instruction",), "sharegpt": ("conversations", "messages"), "text": ("text",)}[fmt]
    if isinstance(rec, dict) and not any(k in rec for k in needs):
        try:
            kind, why = detect_kind(rec, where)
        except DataError:
            kind, why = fmt, ""
        if kind != fmt:
            raise DataError(f"{where}: looks like {_NAMES[kind]} ({why}), but data.format is {fmt}; "
                            f"set DATA_FORMAT={kind} (or data.format={kind}, or auto)")
    return fmt, f"data.format={fmt}"


def _text(rec: dict[str, Any], key: str, where: str, required: bool, example: str, record: bool = True) -> str:
    """A string field (``record``: a field of the record, not of one of its messages)."""
    v = rec.get(key)
    if v is None:
        if required:
            raise DataError(f"{where}: field {key!r} is missing; add it (e.g. \"{key}\": \"{example}\")"
                            + (_columns_hint(rec) if record else ""))
        return ""
    if not isinstance(v, str):
        raise DataError(f"{where}: field {key!r} must be a string, got {type(v).__name__} "
                        f"({str(v)[:40]!r}); e.g. \"{key}\": \"{example}\"")
    return v


def _system(rec: dict[str, Any], where: str) -> str | None:
    system = rec.get("system")
    return None if system is None else _text(rec, "system", where, False, "You are a helpful assistant.") or None


def alpaca_sample(rec: Any, where: str, bad: bool = False) -> Sample:
    """instruction (+ "\\n" + input), output, optional system and history [[user, assistant], ...]."""
    if not isinstance(rec, dict):
        raise DataError(f"{where}: an Alpaca record is an object with instruction/input/output, "
                        f"got {type(rec).__name__}")
    instr = _text(rec, "instruction", where, True, "Summarize the text.")
    inp = _text(rec, "input", where, False, "")
    out = _text(rec, "output", where, True, "The answer.")
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
    return Sample(_system(rec, where), tuple(turns), where, bad, _tools(rec, where))


def _tools(rec: dict[str, Any], where: str) -> str | None:
    """The `tools` field (a list of function schemas, or its JSON text) as the template writes it:
    one JSON object per line; None when there are none."""
    v = rec.get("tools")
    if isinstance(v, str) and v.strip():
        try:
            v = json.loads(v)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: field 'tools' is not valid JSON ({e.msg}); give a list of function "
                            'schemas, e.g. "tools": [{"name": "get_weather", "parameters": {...}}]') from None
    if not v:
        return None
    if not isinstance(v, list) or not all(isinstance(t, dict) for t in v):
        raise DataError(f"{where}: field 'tools' must be a list of function schemas (objects), got {str(v)[:60]!r}")
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in v)


def _tool_calls(calls: Any, where: str) -> str:
    """Tool calls ({name, arguments} or OpenAI's {function: {name, arguments}}; arguments an object or
    its JSON text) as Qwen2.5 writes them: <tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>."""
    out = []
    for call in calls if isinstance(calls, list) else [calls]:
        if isinstance(call, dict) and isinstance(call.get("function"), dict):
            call = call["function"]
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise DataError(f"{where}: a tool call is {{\"name\": ..., \"arguments\": {{...}}}}, "
                            f"got {str(call)[:60]!r}")
        args = call.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: tool call {call['name']!r}: arguments are not valid JSON ({e.msg}); "
                                'give an object, e.g. "arguments": {"city": "Paris"}') from None
        out.append('<tool_call>\n{"name": "' + call["name"] + '", "arguments": '
                   + json.dumps(args, ensure_ascii=False) + "}\n</tool_call>")
    return "\n".join(out)


def _reasoned(message: dict[str, Any], content: str) -> str:
    """An assistant turn's content with its ``reasoning_content`` (if any) opening it as
    ``<think>\\n...\\n</think>\\n\\n``, where the template finds reasoning written inline."""
    r = message.get("reasoning_content")
    return f"<think>\n{r}\n</think>\n\n{content}" if isinstance(r, str) and r else content


def _tool_responses(contents: list[str]) -> str:
    """Consecutive tool results: one user turn of <tool_response> blocks (as the template merges them)."""
    return "\n".join(f"<tool_response>\n{c}\n</tool_response>" for c in contents)


def sharegpt_sample(rec: Any, where: str, bad: bool = False, role_key: str = "", content_key: str = "") -> Sample:
    """conversations [{from, value}] or messages [{role, content}] (+ optional top-level system and tools).

    Tool use: ShareGPT ``function_call`` (the call as JSON) and ``observation`` turns, or OpenAI
    assistant ``tool_calls`` and ``tool`` messages. User and tool turns after the last answer are dropped.
    """
    if not isinstance(rec, dict):
        raise DataError(f"{where}: a ShareGPT record is an object with 'conversations' or 'messages', "
                        f"got {type(rec).__name__}")
    key, rk, ck = ("conversations", "from", "value") if "conversations" in rec else ("messages", "role", "content")
    rk, ck = role_key or rk, content_key or ck
    msgs = rec.get(key)
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: field {key!r} must be a non-empty list of {{\"{rk}\": ..., \"{ck}\": ...}}, "
                        f"got {str(msgs)[:60]!r}")
    system = _system(rec, where)
    turns: list[tuple[str, str]] = []  # role "tool": a tool result, merged into user turns below
    for j, m in enumerate(msgs):
        field = f"{key}[{j}]"
        if not isinstance(m, dict):
            raise DataError(f"{where}: field {field!r} must be an object with {rk!r} and {ck!r}")
        role = _ROLES.get(str(m.get(rk)).lower()) if m.get(rk) is not None else None
        if role is None:
            raise DataError(f"{where}: field '{field}.{rk}' = {m.get(rk)!r} is not a known role; use one of "
                            f"{', '.join(_ROLES)}")
        if role == "function_call":
            try:
                call = json.loads(_text(m, ck, f"{where} {field}", True, '{"name": "f", "arguments": {}}', False))
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: field '{field}.{ck}': a function_call holds the call as JSON "
                                f'({e.msg}); e.g. {{"name": "get_weather", "arguments": {{"city": "Paris"}}}}'
                                ) from None
            turns.append(("assistant", _tool_calls(call, f"{where} {field}")))
            continue
        if role == "assistant" and m.get("tool_calls"):
            content = m.get(ck) or ""
            if not isinstance(content, str):
                raise DataError(f"{where}: field '{field}.{ck}' must be a string or null next to tool_calls")
            calls = _tool_calls(m["tool_calls"], f"{where} {field}")
            turns.append(("assistant", _reasoned(m, f"{content}\n{calls}" if content else calls)))
            continue
        content = _text(m, ck, f"{where} {field}", True, "text", False)
        if role == "system":
            if turns:
                raise DataError(f"{where}: field '{field}': a system message must come first; move it")
            system = content or None
            continue
        turns.append((role, _reasoned(m, content) if role == "assistant" else content))
    merged: list[tuple[str, str]] = []
    for role, group in itertools.groupby(turns, key=lambda t: t[0]):
        if role == "tool":
            merged.append(("user", _tool_responses([c for _, c in group])))
        else:
            merged += list(group)
    n = len(merged)
    while merged and merged[-1][0] == "user":  # nothing to learn after the last answer
        merged.pop()
    return Sample(system, tuple(merged), where, bad, _tools(rec, where), n - len(merged))


def text_sample(rec: Any, where: str, bad: bool = False) -> Sample:
    """A plain-text document ({"text": ...}) for continued pretraining."""
    if not isinstance(rec, dict):
        raise DataError(f"{where}: a plain-text record is an object with 'text', got {type(rec).__name__}")
    return Sample(None, (("text", _text(rec, "text", where, True, "A document.")),), where, bad)


def iter_samples(path: Path, fmt: str = "auto", limit: int = 0, columns: dict[str, str] | None = None,
                 skip: bool = False) -> Iterator[Sample | DataError]:
    """Samples of one file in the format of :func:`file_format` (see :func:`read_samples`)."""
    return read_samples(path, file_format(path, fmt, columns)[0], limit, columns, skip)


def read_samples(path: Path, kind: str, limit: int = 0, columns: dict[str, str] | None = None,
                 skip: bool = False) -> Iterator[Sample | DataError]:
    """Samples of one file of format ``kind``; with ``skip`` a malformed record is yielded as its
    DataError instead of raised."""
    columns = columns or {}
    n = 0
    if kind == "text" and path.suffix == ".txt":
        text, bad = decode(path.read_bytes())
        yield Sample(None, (("text", _fix(text) if bad else text),), str(path), bad)
        return
    for where, rec, bad in iter_raw(path, limit, skip):
        n += 1
        try:
            if isinstance(rec, DataError):
                raise rec
            rec = _mapped(rec, columns)
            if kind == "alpaca":
                s = alpaca_sample(rec, where, bad)
            elif kind == "sharegpt":
                s = sharegpt_sample(rec, where, bad, columns.get("role", ""), columns.get("content", ""))
            else:
                s = text_sample(rec, where, bad)
        except DataError as e:
            if not skip:
                raise
            yield e
        else:
            if bad:
                s = s._replace(system=_fix(s.system), turns=tuple((r, _fix(c)) for r, c in s.turns))
            yield s
        if limit and n >= limit:
            return
    if n == 0:
        raise DataError(f"{path}: no records (empty data set); add records or remove it from data.paths")


@overload
def _fix(s: str) -> str: ...
@overload
def _fix(s: None) -> None: ...
def _fix(s: str | None) -> str | None:
    """Surrogate-escaped invalid bytes -> U+FFFD."""
    if s is None or not SURROGATE.search(s):
        return s
    return s.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def check_data(data_cfg: DataConfig, max_records: int = 3) -> list[str]:
    """Open every data path, parse up to max_records per file; problems (file, record, field, fix)."""
    try:
        sources = resolve_sources(data_cfg) + resolve_sources(data_cfg, val=True)
    except DataError as e:
        return [str(e)]
    problems = []
    for src in sources:
        try:
            for _ in iter_samples(src.path, data_cfg.format, max_records, data_cfg.columns):
                pass
        except DataError as e:
            problems.append(str(e))
    return problems
