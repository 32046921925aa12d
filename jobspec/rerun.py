"""What running ``make train`` again in a run directory means (decided before any work).

- the same settings and a finished run: "already finished at step N (OUTPUT_DIR/hf); nothing to do";
- a raised ``train.max_steps`` / ``train.epochs``: continue from the last checkpoint to the new end
  (the learning-rate schedule is recomputed over the new total, see README "Running again");
- a changed setting that changes what is trained (:data:`TRAINING_KEYS`): refused, naming the keys
  and the two ways out; layout settings (tp, dp, devices) may change, a checkpoint is resharded.

Other data is refused by ``jobspec/data/runcheck.py``. Pure Python: the launcher runs it first.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from jobspec.checkpoints import STATE, usable, ways_out
from jobspec.config import Recipe
from jobspec.rundir import run_dir_of

TRAINING_KEYS = ("train.lr", "train.betas", "train.eps", "train.weight_decay", "train.warmup_steps", "train.schedule",
                 "train.min_lr", "train.clip_grad", "train.seed", "data.seq_len", "data.packing",
                 "data.max_tokens_per_batch")
LENGTH_KEYS = ("train.max_steps", "train.epochs")


class RunSettingsChanged(ValueError):
    """The recipe changes what the run in OUTPUT_DIR trained; nothing was done."""


def _value(recipe: Recipe, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(recipe, section), name)


def run_settings(recipe: Recipe) -> dict[str, Any]:
    """The settings a checkpoint records: what was trained, and for how long."""
    return {k: _value(recipe, k) for k in TRAINING_KEYS + LENGTH_KEYS}


def changed_settings(saved: dict[str, Any], recipe: Recipe) -> list[str]:
    """``key was X, now Y`` for every training setting (not the length) that differs from ``saved``."""
    now = run_settings(recipe)
    return [f"{k} was {saved[k]!r}, now {now[k]!r}" for k in TRAINING_KEYS if k in saved and saved[k] != now[k]]


def finished_already(recipe: Recipe) -> str | None:
    """The line to print when the run in OUTPUT_DIR is finished with these very settings (nothing to do);
    None when there is work (no checkpoint, train.resume=never, a longer run asked for). Raises
    :class:`RunSettingsChanged` when a training setting differs from the checkpoint's."""
    if recipe.train.resume == "never":
        return None
    found = usable(run_dir_of(recipe).checkpoints, log=lambda _: None)
    path = Path(recipe.train.resume) if recipe.train.resume != "auto" else found[0] if found else None
    try:
        state = json.loads((path / STATE).read_text()) if path else {}
    except (OSError, ValueError):
        return None  # damaged: the worker skips it with the reason
    saved = state.get("settings") or {}
    changes = changed_settings(saved, recipe)
    if changes:
        raise RunSettingsChanged(f"{recipe.output_dir} holds a run trained with other settings (checkpoint "
                                 f"{path.name if path else '-'}): {'; '.join(changes)}. Nothing was done. "
                                 f"{ways_out(recipe.output_dir)}")
    now = run_settings(recipe)
    if state.get("finished") and all(saved.get(k) == now[k] for k in LENGTH_KEYS):
        return (f"already finished at step {state['step']} ({run_dir_of(recipe).hf}); nothing to do "
                "(raise train.max_steps or train.epochs to train on from there)")
    return None


def rerun_answer(recipe: Recipe, who: str) -> int | None:
    """:func:`finished_already` said on the console as ``[who]``: 0 when the run is finished with these settings,
    2 when a training setting changed; None when there is work."""
    try:
        done = finished_already(recipe)
    except RunSettingsChanged as e:
        print(f"[{who}] {e}", file=sys.stderr)
        return 2
    if done:
        print(f"[{who}] {done}", flush=True)
        return 0
    return None
