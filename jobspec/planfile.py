"""What a rank or prepare-data reads: plan.json (the launcher's resolved recipe and run directory), a
recipe JSON, or a recipe YAML. Pure Python."""
from __future__ import annotations

import json
from pathlib import Path

from jobspec.config import ConfigError, Recipe, load_recipe
from jobspec.rundir import RunDir, run_dir_of


def load_plan(path: str | Path) -> Recipe:
    """The resolved recipe a rank or prepare-data runs: ``plan.json`` (its "recipe"), a recipe JSON, or YAML.
    Raises :class:`ConfigError`; an unreadable or malformed file as one naming the path."""
    return load_run(path)[0]


def load_run(path: str | Path) -> tuple[Recipe, RunDir]:
    """:func:`load_plan`'s recipe and its run directory: plan.json's ``run_dir``, else ``run_dir_of(recipe)``."""
    p = Path(path)
    if p.suffix in (".yaml", ".yml"):
        recipe = load_recipe(str(p))
        return recipe, run_dir_of(recipe)
    try:
        raw = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError([f"{p}: {e}"]) from None
    recipe = load_recipe(raw=raw.get("recipe", raw) if isinstance(raw, dict) else raw)
    run = raw.get("run_dir") if isinstance(raw, dict) else None
    return recipe, RunDir.from_json(run) if isinstance(run, dict) else run_dir_of(recipe)
