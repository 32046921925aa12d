"""The launcher's last step before plan.json: every path the workers and the data code read, made explicit.

``finished(recipe, nproc)`` fills ``model.dir`` (the created tiny model's ``<output_dir>/base-model``),
``data.cache_dir`` (``<output_dir>/data``), ``model.tokenizer`` and ``launch.nproc_per_node``; the launcher
serialises the result once. Workers and ``jobspec/data`` read these fields and never derive them. Pure Python.
"""
from __future__ import annotations

import copy
from pathlib import Path

from jobspec.config import ASSETS_DIR, Recipe, creates_tiny_model, resolved_model_dir
from jobspec.rundir import run_dir_of

BUNDLED_TOKENIZER = ASSETS_DIR / "tokenizer" / "tokenizer.json"  # the created tiny model's (jobspec/tiny.py)


def tokenizer_of(recipe: Recipe) -> str:
    """model.tokenizer, else the bundled one for the created tiny model (its copy is the same file), else
    ``<model dir>/tokenizer.json``."""
    if recipe.model.tokenizer:
        return recipe.model.tokenizer
    if creates_tiny_model(recipe):
        return str(BUNDLED_TOKENIZER)
    model_dir = resolved_model_dir(recipe)
    return str(Path(model_dir) / "tokenizer.json") if model_dir else ""


def finished(recipe: Recipe, nproc: int = 0) -> Recipe:
    """A copy of ``recipe`` with its model directory, token cache, tokenizer and (``nproc`` > 0) this node's
    worker count explicit; a finished recipe comes back unchanged."""
    r = copy.deepcopy(recipe)
    r.model.tokenizer = tokenizer_of(recipe)
    r.model.dir = resolved_model_dir(recipe)
    r.data.cache_dir = str(run_dir_of(recipe).data)
    r.launch.nproc_per_node = nproc or r.launch.nproc_per_node
    return r
