"""Before the token cache is rebuilt: would the rebuild change the data a resumable run trained?

A run directory holding a checkpoint trains one data set. When the cache no longer matches the
recipe (other ``DATA``, changed files, other data settings or tokenizer) and ``train.resume`` would
resume that checkpoint, rebuilding the cache first would overwrite the data of the run that the
worker then refuses. :func:`check_same_data` refuses before anything is written, naming in words
what differs and the two ways out. Pure Python (the launcher's prepare-data runs it).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jobspec.checkpoints import STATE, data_id, usable, ways_out
from jobspec.config import Recipe
from jobspec.data import cache
from jobspec.data.files import DataError, resolve_sources
from jobspec.fsutil import file_hash
from jobspec.rundir import run_dir_of


class RunDataChanged(DataError):
    """The recipe's data differs from the data the run in OUTPUT_DIR trained; nothing was written."""


def _sources_now(recipe: Recipe) -> list[dict[str, Any]]:
    return [cache.source_entry(s, with_hash=False) for s in
            resolve_sources(recipe.data) + resolve_sources(recipe.data, val=True)]


def data_changes(old: dict[str, Any], recipe: Recipe, tokenizer_path: str | Path) -> list[str]:
    """What differs between the cache manifest ``old`` and the recipe's data, one phrase each."""
    changes = []
    was, now = old.get("settings", {}), cache.settings_of(recipe, tokenizer_path)
    for key in sorted(set(was) | set(now)):
        if was.get(key) != now.get(key):
            changes.append("the tokenizer (tokenizer.json of the model) changed" if key == "tokenizer_sha256" else
                           f"data.{key} was {was.get(key)!r}, now {now.get(key)!r}")
    before, after = old.get("sources", []), _sources_now(recipe)
    if [(s["path"], s.get("weight")) for s in before] != [(s["path"], s["weight"]) for s in after]:
        changes.append(f"DATA was {', '.join(s['path'] for s in before)} ({old.get('num_samples', 0):,} samples), "
                       f"now {', '.join(s['path'] for s in after)}")
        return changes
    for o, n in zip(before, after):
        if o.get("size") != n["size"]:
            changes.append(f"{n['path']} changed since the run read it ({o.get('size', 0):,} -> {n['size']:,} bytes)")
        elif not cache.same_stat(o, n) and file_hash(Path(n["path"])) != o.get("sha256"):
            changes.append(f"{n['path']} changed since the run read it (same size, other contents)")
    return changes


def check_same_data(recipe: Recipe, tokenizer_path: str | Path) -> None:
    """Raise :class:`RunDataChanged` when rebuilding the cache would change the data of the checkpoint
    that ``train.resume`` would continue; call it only when the cache is not fresh."""
    if recipe.train.resume == "never":
        return
    found = usable(run_dir_of(recipe).checkpoints, log=lambda _: None)
    ckpt = Path(recipe.train.resume) if recipe.train.resume != "auto" else found[0] if found else None
    old = cache.read_manifest(cache.cache_dir_for(recipe))
    if ckpt is None or old is None:
        return
    try:
        trained = json.loads((ckpt / STATE).read_text()).get("identity", {}).get("data")
    except (OSError, ValueError):
        return  # a damaged checkpoint: the worker skips it with the reason
    if trained != data_id(old):
        return  # the cache is not the one the checkpoint trained: nothing of the run is lost by rebuilding it
    changes = data_changes(old, recipe, tokenizer_path)
    if changes:
        raise RunDataChanged(f"{recipe.output_dir} holds a run trained on other data (checkpoint {ckpt.name}): "
                             + "; ".join(changes) + f". Nothing was written. {ways_out(recipe.output_dir)}")
