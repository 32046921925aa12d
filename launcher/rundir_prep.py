"""The run directory before a node's workers start: each node's housekeeping.

Run by the launcher on every node (node-local OUTPUT_DIRs each get theirs; on a shared one the
nodes may race, which is safe: see :func:`tidy_run_dir`).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from jobspec.checkpoint_index import model_hash, tidy
from jobspec.config import Recipe, resolved_model_dir
from jobspec.fsutil import remove_stale_temps
from jobspec.rundir import run_dir_of
from launcher.plan import Plan


def tidy_run_dir(recipe: Recipe, plan: Plan, log: Callable[[str], None]) -> None:
    """This node's housekeeping before its workers start, its results put into ``plan``:
    :func:`jobspec.checkpoint_index.tidy` (stale temporary directories, train.resume=never's archive), after which
    the workers resume only this job's own checkpoints (a restart continues, never starts over); the base
    model hashed once per node for the run identity (``plan.model_hash``, none without a config.json: the
    worker says what is missing), remembered in OUTPUT_DIR so that a rerun reads only changed files; no rank
    reads the weights again for it."""
    run = plan.run_dir
    tidy(run, recipe.train.resume == "never", log)
    if recipe.train.resume == "never":
        plan.recipe["train"]["resume"] = "auto"
    model_dir = Path(resolved_model_dir(recipe))
    if (model_dir / "config.json").is_file():
        plan.model_hash = model_hash(model_dir, run.hashes, log)


def cleaned(recipe: Recipe, log: Callable[[str], None]) -> Recipe:
    """``recipe``, after removing the temporary directories an interrupted export, save or prepare of this host
    left in its run directory (only those of dead processes: a live job's are its own, see
    jobspec.fsutil.remove_stale_temps). Every command that writes there (train, prepare-data, export) starts so."""
    remove_stale_temps(*run_dir_of(recipe).temp_parents, log=lambda m: log(m.removeprefix("[cleanup] ")))
    return recipe
