"""Reading a recipe: typed coercion of YAML values and ``key=value`` overrides, problems collected.

Generic over the schema's dataclasses (``build(cls, raw, ...)``) so that it imports nothing of
``finetune``: ``jobspec/config.py`` holds the schema and its rules and uses this module, never
the other way round. Problems are :class:`Problem` s, raised together as one :class:`ConfigError`.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class Problem:
    """One config problem: the dotted ``key``, what is wrong, a value that works, where the value came from.

    ``key`` is empty for problems that belong to no key (a malformed override, an unknown recipe).
    ``value`` is the offending value as written (``repr``), ``where`` a recipe line (``recipes/x.yaml:12``).
    """

    key: str
    message: str
    example: str = ""
    value: str | None = None
    where: str = ""

    def text(self, via: str = "", raw: str | None = None) -> str:
        """One line naming the key, or the variable ``via`` it was set with (``raw``: the text it held)."""
        if not self.key:
            return f"{self.where}: {self.message}" if self.where else self.message
        if via:
            fix = f" (e.g. {via}={self.example})" if self.example else ""
            return f"{via}={raw!r} ({self.key}): {self.message}{fix}"
        head = self.key if self.value is None else f"{self.key}={self.value}"
        fix = f" (e.g. {self.key}={self.example})" if self.example else ""
        return f"{self.where + ': ' if self.where else ''}{head}: {self.message}{fix}"


class ConfigError(ValueError):
    """Every problem found in a recipe, each line naming the key and a fix.

    ``items`` are the structured :class:`Problem` s; ``problems`` their lines as rendered by ``render``
    (the launcher passes one that names the environment variable a key came from).
    """

    def __init__(self, problems: Sequence[Problem | str], render: Callable[[Problem], str] = Problem.text):
        self.items = [p if isinstance(p, Problem) else Problem("", p) for p in problems]
        self.problems = [render(p) for p in self.items]
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in self.problems))


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_KEY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _short(x: float) -> str:
    """A float as a user writes it: 2e-5, 0.01, 65536."""
    return re.sub(r"e([+-])0*(\d)", lambda m: "e" + m.group(1).replace("+", "") + m.group(2), f"{x:g}")


def _example(tp: Any) -> str:
    return {int: "8", float: "2e-5", bool: "true", str: "text"}.get(tp, "[...]")


def _coerce(value: Any, tp: Any, key: str, problems: list[Problem], default: Any = None) -> Any:
    """Convert a YAML value or an override string to the annotated type (``default``: the field's, for
    the example of a bad number: ``MASTER_PORT=8118``, not a generic one)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Literal:  # the schema's allowed values, written once in the annotation
        if str(value) not in args:
            problems.append(Problem(key, f"must be one of {', '.join(args)}", args[0], repr(value)))
            return args[0]
        return str(value)
    if origin in (typing.Union, types.UnionType) and type(None) not in args:  # a number or a word: int | "auto"
        words = [w for a in args if typing.get_origin(a) is typing.Literal for w in typing.get_args(a)]
        if str(value).strip() in words:
            return str(value).strip()
        number = next(a for a in args if a in (int, float))
        wrong: list[Problem] = []
        out = _coerce(value, number, key, wrong, default)
        problems += [dataclasses.replace(p, message=f"{p.message} or {' or '.join(words)}", example=words[0])
                     for p in wrong]
        return out
    if origin is typing.Union or (origin is not None and type(None) in args):
        inner = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in {"", "null", "none", "auto"}):
            return None
        return _coerce(value, inner[0], key, problems)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # a schema section (a class, never an instance)
        if not isinstance(value, dict):
            problems.append(Problem(key, "expected a mapping of settings", value=repr(value)))
            return tp()
        return build(tp, value, key + ".", problems)
    if tp is dict or origin is dict:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass
        if not isinstance(value, dict):
            problems.append(Problem(key, "expected a mapping", "'{\"hidden_size\": 64}'", repr(value)))
            return None
        return value
    if origin is list:
        return _coerce_list(value, args[0] if args else str, key, problems, default)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if str(value).strip().lower() in _TRUE:
            return True
        if str(value).strip().lower() in _FALSE:
            return False
        problems.append(Problem(key, "expected true or false", "true", repr(value)))
        return False
    if tp in (int, float):
        try:
            if isinstance(value, bool):
                raise ValueError
            f = float(value)
            if not math.isfinite(f) or (tp is int and f != int(f)):
                raise ValueError
            return int(f) if tp is int else f
        except (TypeError, ValueError):
            what = "an integer" if tp is int else "a finite number"
            # a default of 0 or 1 illustrates nothing
            ex = str(default) if type(default) is int and default > 1 else _short(default) \
                if type(default) is float and default > 0 else _example(tp)
            problems.append(Problem(key, f"expected {what}", ex, repr(value)))
            return tp()
    if tp is str:
        if isinstance(value, (dict, list)):
            problems.append(Problem(key, "expected text", value=repr(value)))
            return ""
        return "" if value is None else str(value)
    return value


def _split_list(text: str) -> list[str]:
    """An override's list: ``a,b`` or YAML's ``[a, b]``, items stripped of spaces and quotes (``''``: empty)."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1].strip()
    return [v.strip().strip("'\"") for v in text.split(",")] if text else []


def _coerce_list(value: Any, item: Any, key: str, problems: list[Problem], default: Any) -> list[Any]:
    """A list from YAML or an override string; an empty entry (``DATA=a.jsonl,``) is refused, not read."""
    if isinstance(value, str):
        value = _split_list(value)
    if not isinstance(value, (list, tuple)):
        problems.append(Problem(key, "expected a list", "a,b", repr(value)))
        return []
    given = [str(v) for v in value if v not in (None, "")]
    if len(given) < len(value):
        empty = ", ".join(str(i + 1) for i, v in enumerate(value) if v in (None, ""))
        problems.append(Problem(key, f"entry {empty} of {len(value)} is empty (a trailing or doubled comma?); list "
                                "only the entries you mean", ",".join(given) or "a,b",
                                repr(",".join("" if v is None else str(v) for v in value))))
        return []
    out: list[Any] = []
    for v in value:
        wrong: list[Problem] = []
        out.append(_coerce(v, item, key, wrong))
        if wrong:  # one line naming the entry and the whole list, with an example of the list
            ex = ",".join(map(str, default)) if default else wrong[0].example
            problems.append(Problem(key, f"entry {v!r}: {wrong[0].message}", ex, repr(value)))
            return []
    return out


def build(cls: type, raw: dict[str, Any], prefix: str, problems: list[Problem]) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    defaults = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in raw.items():
        if k not in hints:
            close = difflib.get_close_matches(str(k), names, n=1)
            hint = f"did you mean {prefix}{close[0]}?" if close else f"known keys: {', '.join(names)}"
            problems.append(Problem(f"{prefix}{k}", f"unknown key; {hint}"))
            continue
        kwargs[k] = _coerce(v, hints[k], prefix + k, problems, defaults[k])
    return cls(**kwargs)


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dotted, v in flat.items():
        d = out
        parts = dotted.split(".")
        for p in parts[:-1]:
            d = d.setdefault(p, {})
            if not isinstance(d, dict):
                break
        else:
            d[parts[-1]] = v
    return out


def merge(base: dict[str, Any], over: dict[str, Any], whole: frozenset[str] = frozenset(),
          prefix: str = "") -> dict[str, Any]:
    """``over`` merged into ``base`` key by key; a mapping at a dotted key in ``whole`` is replaced whole."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and f"{prefix}{k}" not in whole:
            out[k] = merge(out[k], v, whole, f"{prefix}{k}.")
        else:
            out[k] = v
    return out


def parse_overrides(items: list[str]) -> tuple[dict[str, str], list[Problem]]:
    """``["train.lr=1e-5", ...]`` -> ``{"train.lr": "1e-5"}`` plus problems for malformed items."""
    flat, problems = {}, []
    for item in items:
        key = item.split("=", 1)[0].strip()
        if "=" not in item or not _KEY.fullmatch(key):
            problems.append(Problem("", f"override {item!r}: expected key=value with a dotted recipe key "
                                        "(e.g. train.lr=1e-5)"))
            continue
        flat[key] = item.split("=", 1)[1]
    return flat, problems


def _key_lines(node: yaml.Node, prefix: str = "") -> dict[str, int]:
    """Dotted key -> 1-based line of its value in a composed YAML mapping."""
    out: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = f"{prefix}{k.value}"
            out[key] = k.start_mark.line + 1
            out.update(_key_lines(v, key + "."))
    return out


def read_recipe(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """The recipe's mapping and the line of each key (``recipes/x.yaml:12`` in problems)."""
    try:
        text = path.read_text()
        data = yaml.safe_load(text) or {}
        lines = _key_lines(yaml.compose(text))
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError([f"{path}: unreadable ({e}); RECIPE names a recipe in recipes/ or a YAML file"]) from None
    except yaml.YAMLError as e:
        raise ConfigError([f"{path}: not valid YAML: {e}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: a recipe is a mapping of sections (model:, data:, train:, ...)"])
    return data, lines


def overridden(key: str, keys: Iterable[str]) -> str | None:
    """The override among ``keys`` that set ``key`` (itself, a parent or a child), or None."""
    for k in keys:
        if k == key or key.startswith(k + ".") or k.startswith(key + "."):
            return k
    return None


def parse_size(text: str) -> int:
    """'2GB' / '500MB' / '1024' -> bytes (decimal units, like Hugging Face's max_shard_size)."""
    t = str(text).strip().upper().replace(" ", "")
    units = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3, "TIB": 2**40, "GIB": 2**30,
             "MIB": 2**20, "KIB": 2**10, "B": 1}
    for u, m in units.items():
        if t.endswith(u) and t[: -len(u)]:
            return int(float(t[: -len(u)]) * m)
    return int(t)
