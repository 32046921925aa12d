"""Reading a recipe: its name or path, the YAML and the dotted overrides -> a validated :class:`Recipe`.

Problems are collected and raised all at once (:class:`ConfigError`), a value from the recipe file naming its line.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jobspec.config import RECIPES_DIR, REPO_ROOT, ConfigError, Problem, Recipe, overridden
from jobspec.recipe_parse import build, merge, nest, read_recipe
from jobspec.validate import validate

# Mappings an override replaces whole instead of key by key (model.init: the tiny model's config.json fields)
WHOLE_KEYS = frozenset({"model.init"})


def resolve_recipe_path(name_or_path: str) -> Path:
    """A recipe name in recipes/ (with or without .yaml) or a path to a YAML file."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    for cand in (RECIPES_DIR / f"{name_or_path}.yaml", RECIPES_DIR / name_or_path, p):
        if cand.is_file():
            return cand
    known = ", ".join(sorted(x.stem for x in RECIPES_DIR.glob("*.yaml")))
    if p.is_dir():
        yamls = sorted(x.name for x in p.glob("*.y*ml"))
        raise ConfigError([f"RECIPE={name_or_path!r}: a directory, not a recipe; give a YAML file"
                           + (f" in it (e.g. RECIPE={p / yamls[0]})" if yamls else f" or one of: {known}")])
    raise ConfigError([f"RECIPE={name_or_path!r}: no such recipe; use one of: {known}, or a path to a YAML file"])


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def load_recipe(name_or_path: str | None = None, overrides: dict[str, Any] | None = None,
                raw: dict[str, Any] | None = None, render: Callable[[Problem], str] = Problem.text) -> Recipe:
    """Recipe YAML (or ``raw``) + dotted overrides -> validated :class:`Recipe`.

    Raises :class:`ConfigError` listing every problem at once, one per key; a problem about a value
    from the recipe file names its line, ``render`` words the rest (the launcher names env variables).
    """
    problems: list[Problem] = []
    data: dict[str, Any] = {}
    lines: dict[str, int] = {}
    where = ""
    if raw is not None:
        data = raw
    elif name_or_path:
        path = resolve_recipe_path(name_or_path)
        data, lines = read_recipe(path)
        data.setdefault("name", path.stem)
        where = _shown(path)
    data = merge(data, nest(overrides or {}), WHOLE_KEYS)
    if "layout" in data and raw is None:  # only a plan's recipe (raw) carries one
        problems.append(Problem("layout", "decided by the launcher from the parallel section (Recipe.resolved), "
                                "not set in a recipe; set parallel.tp, parallel.dp, parallel.shard_optimizer ...",
                                "parallel.shard_optimizer=false"))
        del data["layout"]
    recipe: Recipe = build(Recipe, data, "", problems)
    bad = {p.key for p in problems}
    problems += [p for p in validate(recipe) if p.key not in bad]  # a value that failed to parse fails no range
    if problems:
        over = list(overrides or {})
        problems = [dataclasses.replace(p, where=f"{where}:{lines[p.key]}")
                    if p.key in lines and not overridden(p.key, over) else p for p in problems]
        raise ConfigError(problems, render)
    return recipe
