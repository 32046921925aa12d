"""What a rank or prepare-data reads: plan.json (the launcher's resolved recipe and run directory), a
recipe JSON, or a recipe YAML. Pure Python."""
from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from jobspec.config import ConfigError, Recipe, load_recipe
from jobspec.rundir import RunDir, run_dir_of


class Run(NamedTuple):
    """What a worker reads of plan.json: the resolved recipe, the run directory's paths and the base model's
    identity the launcher hashed ("" in a recipe file or an older plan: the worker hashes it)."""

    recipe: Recipe
    run_dir: RunDir
    model_hash: str = ""


def load_plan(path: str | Path) -> Recipe:
    """The resolved recipe a rank or prepare-data runs: ``plan.json`` (its "recipe"), a recipe JSON, or YAML.
    Raises :class:`ConfigError`; an unreadable or malformed file as one naming the path."""
    return load_run(path).recipe


def load_run(path: str | Path) -> Run:
    """:func:`load_plan`'s recipe, its run directory (plan.json's ``run_dir``, else ``run_dir_of(recipe)``)
    and plan.json's ``model_hash``."""
    p = Path(path)
    if p.suffix in (".yaml", ".yml"):
        recipe = load_recipe(str(p))
        return Run(recipe, run_dir_of(recipe))
    try:
        raw = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError([f"{p}: {e}"]) from None
    plan = raw if isinstance(raw, dict) else {}
    recipe = load_recipe(raw=plan.get("recipe", raw))
    run, model_hash = plan.get("run_dir"), plan.get("model_hash")
    if model_hash is not None and not isinstance(model_hash, str):
        raise ConfigError([f"{p}: model_hash {model_hash!r} is not a string; make the plan again (python -m "
                           "launcher plan)"])
    return Run(recipe, RunDir.from_json(run) if isinstance(run, dict) else run_dir_of(recipe), model_hash or "")
