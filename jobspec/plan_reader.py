"""What a rank or prepare-data reads: plan.json (the launcher's resolved recipe and run directory), a
recipe JSON, or a recipe YAML. Pure Python."""
from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from jobspec.config import ConfigError, Recipe
from jobspec.finish import finished
from jobspec.recipe_load import load_recipe
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


def unplanned(recipe: Recipe) -> Run:
    """A recipe that no launcher planned (a recipe file, a test's): finished as the launcher does
    (jobspec/finish.py), its run directory the one rule's (``run_dir_of``)."""
    recipe = finished(recipe)
    return Run(recipe, run_dir_of(recipe))


def load_run(path: str | Path) -> Run:
    """:func:`load_plan`'s recipe (finished, jobspec/finish.py: a plan's comes so), its run directory (plan.json's
    ``run_dir``, else ``run_dir_of(recipe)``) and plan.json's ``model_hash``."""
    p = Path(path)
    if p.suffix in (".yaml", ".yml"):
        return unplanned(load_recipe(str(p)))
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
    if not isinstance(run, dict):
        return unplanned(recipe)._replace(model_hash=model_hash or "")
    decided = RunDir.from_json(run)
    recipe.data.cache_dir = str(decided.data)  # the plan's run_dir wins (the launcher's plan: the same path)
    return Run(finished(recipe), decided, model_hash or "")
