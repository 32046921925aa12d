"""A recipe key's facts, kept on its dataclass field: ``lr: float = key(2e-5, gt=0, example="2e-5", training=True)``.

From these facts, and nowhere else, come: ``validate``'s range checks (:func:`range_problems`), the settings a
rerun may not change (:func:`training_keys`, jobspec/rerun.py), the token cache's settings (:func:`cache_settings`,
jobspec/data/cache.py), the recipe keys that hold paths and the environment variables that set keys
(:func:`path_keys`, :func:`env_keys`, launcher/settings.py's contract). Pure Python.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import MISSING, dataclass
from typing import Any, Literal

from jobspec.recipe_parse import Problem

FACTS = "facts"  # the metadata name


@dataclass(frozen=True)
class Facts:
    """What a key is: its range, what it changes, whether it holds a path, its environment variable."""

    ge: float | None = None  # in range: value >= ge (and > gt, <= le, < lt)
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    rule: str = ""  # the problem's words when out of range; default "must be >= N" / "must be > N"
    example: str = ""  # a good value for the problem's fix (a path key: an example under a data dir)
    training: bool = False  # changes what is trained: a rerun with another value is refused
    cache: Literal["", "always", "when_set"] = ""  # in the token cache's settings (when_set: unless the default)
    path: Literal["", "input", "output"] = ""  # holds paths: made absolute for the workers
    env: str = ""  # the environment variable that sets it
    env_help: str = ""  # its line in the env table; "{default}" is the key's default


NO_FACTS = Facts()


def key(default: Any = MISSING, *, factory: Any = MISSING, **facts: Any) -> Any:
    """A dataclass field with ``default`` (or ``factory``) and these :class:`Facts`."""
    meta = {FACTS: Facts(**facts)}
    if factory is not MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def facts(obj: Any, prefix: str = "") -> Iterator[tuple[str, Facts, Any, dataclasses.Field[Any]]]:
    """(dotted key, facts, value, field) of every key of the dataclass instance ``obj``, depth first in field order
    (a section, e.g. ``data.clean``, is itself a key before its own keys)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        yield prefix + f.name, f.metadata.get(FACTS, NO_FACTS), value, f
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            yield from facts(value, f"{prefix}{f.name}.")


def _in_range(v: float, k: Facts) -> bool:
    return ((k.ge is None or v >= k.ge) and (k.gt is None or v > k.gt) and (k.le is None or v <= k.le)
            and (k.lt is None or v < k.lt))


def _rule(k: Facts) -> str:
    return k.rule or (f"must be >= {k.ge:g}" if k.ge is not None else f"must be > {k.gt:g}")


def range_problems(obj: Any, prefix: str = "", skip: tuple[str, ...] = ()) -> list[Problem]:
    """A problem for each number of ``obj`` outside its key's range (``skip``: sections that check themselves)."""
    out = []
    for name, k, v, _ in facts(obj, prefix):
        if name.startswith(tuple(f"{prefix}{s}." for s in skip)) or isinstance(v, bool):
            continue
        if isinstance(v, (int, float)) and not _in_range(v, k):
            out.append(Problem(name, _rule(k), k.example, repr(v)))
    return out


def training_keys(obj: Any) -> tuple[str, ...]:
    """The keys that change what is trained (a rerun with another value is refused)."""
    return tuple(name for name, k, _, _ in facts(obj) if k.training)


def cache_settings(obj: Any) -> dict[str, Any]:
    """The values of ``obj``'s keys that change the token cache's content: ``always`` ones, ``when_set`` ones
    only where they differ from the default (so that a cache made before such a key existed stays fresh)."""
    out = {}
    for name, k, v, f in facts(obj):
        if k.cache == "always" or (k.cache == "when_set" and v != _default(f)):
            out[name] = dataclasses.asdict(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v
    return out


def _default(f: dataclasses.Field[Any]) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def path_keys(obj: Any) -> dict[str, tuple[str, str]]:
    """key -> (input | output, an example under a data dir) for each key that holds paths."""
    return {name: (k.path, k.example) for name, k, _, _ in facts(obj) if k.path}


def env_keys(obj: Any) -> dict[str, tuple[str, str]]:
    """environment variable -> (key, its meaning, "{default}" filled in) for each key one sets."""
    return {k.env: (name, k.env_help.replace("{default}", str(_default(f)))) for name, k, _, f in facts(obj) if k.env}
