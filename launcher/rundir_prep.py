"""The run directory before a node's workers start: each node's housekeeping.

Run by the launcher on every node (node-local OUTPUT_DIRs each get theirs; on a shared one the
nodes may race, which is safe: see :func:`tidy_run_dir`).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from jobspec.checkpoints import archive_checkpoints, checkpoint_root, model_hash
from jobspec.config import Recipe, resolved_model_dir
from jobspec.data.cache import cache_dir_for
from jobspec.fsutil import remove_stale_temps
from jobspec.rundir import RunDir


def tidy_run_dir(recipe: Recipe, log: Callable[[str], None]) -> str:
    """This node's housekeeping before its workers start; the base model's identity for the plan ("" when the
    model directory has no config.json: the worker says what is missing).

    The temporary directories of this host's dead processes are removed (another host's are left to it),
    train.resume=never's checkpoints moved aside by one rename (a node racing on shared storage finds
    nothing left to move), and the base model hashed once per node for the run identity, remembered
    in OUTPUT_DIR so that a rerun reads only changed files; no rank reads the weights again for it."""
    out = Path(recipe.output_dir)
    remove_stale_temps(out, checkpoint_root(out), cache_dir_for(recipe).parent, log=print)
    if recipe.train.resume == "never":
        archive_checkpoints(out, print)
    model_dir = Path(resolved_model_dir(recipe))
    return model_hash(model_dir, RunDir(out).hashes, log) if (model_dir / "config.json").is_file() else ""
