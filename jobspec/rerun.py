"""What running ``make train`` again in a run directory means (decided before any work).

- the same settings and a finished run: "already finished at step N (OUTPUT_DIR/hf); nothing to do";
- a raised ``train.max_steps`` / ``train.epochs``: continue from the last checkpoint to the new end
  (the learning-rate schedule is recomputed over the new total, docs/training.md "Running again");
- a changed setting that changes what is trained (:data:`TRAINING_KEYS`): refused, naming the keys
  and the two ways out; layout settings (tp, dp, devices) may change, a checkpoint is resharded.

Other data is refused by ``jobspec/data/runcheck.py``. Pure Python: the launcher runs it first.
"""
from __future__ import annotations

import functools
import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from jobspec.checkpoint_index import STATE, usable, ways_out
from jobspec.config import Recipe
from jobspec.hf_files import ADAPTER_CONFIG, ADAPTER_FILE, INDEX, SINGLE
from jobspec.keys import training_keys
from jobspec.lora_config import LoraConfig
from jobspec.rundir import run_dir_of

TRAINING_KEYS = training_keys(Recipe())  # the keys whose facts say so (jobspec/keys.py)
LORA_KEYS = tuple(f"lora.{f.name}" for f in fields(LoraConfig))  # recorded by a LoRA run
LENGTH_KEYS = ("train.max_steps", "train.epochs")
GLOBAL_BATCH = "global batch (train.micro_batch_size x train.grad_accum x dp)"


class RunSettingsChanged(ValueError):
    """The recipe changes what the run in OUTPUT_DIR trained; nothing was done."""


def _value(recipe: Recipe, key: str) -> Any:
    return functools.reduce(getattr, key.split("."), recipe)


def run_settings(recipe: Recipe) -> dict[str, Any]:
    """The settings a checkpoint records: what was trained (a LoRA run's every ``lora.*`` key, the global batch
    of a resolved recipe), and for how long."""
    keys = TRAINING_KEYS + (LORA_KEYS if recipe.train.method == "lora" else ()) + LENGTH_KEYS
    out = {k: _value(recipe, k) for k in keys}
    if recipe.layout is not None:
        out[GLOBAL_BATCH] = recipe.layout.global_batch
    return out


def changed_settings(saved: dict[str, Any], recipe: Recipe) -> list[str]:
    """``key was X, now Y`` for every training setting (not the length) that differs from ``saved`` (a key one side
    does not record, e.g. by an older version, is not compared; the method is)."""
    now = run_settings(recipe)
    return [f"{k} was {saved[k]!r}, now {now[k]!r}" for k in now
            if k not in LENGTH_KEYS and k in saved and _plain(saved[k]) != _plain(now[k])]


def _plain(v: Any) -> Any:
    """A setting as its checkpoint's JSON holds it (a tuple is a list there)."""
    return list(v) if isinstance(v, tuple) else v


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
        raise _refusal(recipe, path, "with other settings", changes)
    now = run_settings(recipe)
    if not state.get("finished") or any(saved.get(k) != now[k] for k in LENGTH_KEYS):
        return None
    data = data_changes_of(recipe, state)
    if data:
        raise _refusal(recipe, path, "on other data", data)
    missing = missing_outputs(recipe)
    if missing:
        print(f"[rerun] the run finished at step {state['step']} but {missing[0]} is missing or unreadable (its "
              "export or inference check was interrupted): doing them again from the final checkpoint", flush=True)
        return None
    return (f"already finished at step {state['step']} ({run_dir_of(recipe).hf}); nothing to do "
            "(raise train.max_steps or train.epochs to train on from there)")


def _refusal(recipe: Recipe, path: Path | None, what: str, changes: list[str]) -> RunSettingsChanged:
    return RunSettingsChanged(f"{recipe.output_dir} holds a run trained {what} (checkpoint {path.name if path else '-'}"
                              f"): {'; '.join(changes)}. Nothing was done. {ways_out(recipe.output_dir)}")


def data_changes_of(recipe: Recipe, state: dict[str, Any]) -> list[str]:
    """What differs between the recipe's data and the data the checkpoint with ``state`` trained, when its token
    cache is still the one it trained (jobspec/data/runcheck.py); [] when that cannot be told."""
    from jobspec.checkpoint_index import data_id
    from jobspec.config import ConfigError
    from jobspec.data import cache
    from jobspec.data.prepare import tokenizer_checked
    from jobspec.data.runcheck import data_changes
    from jobspec.finish import finished

    done = finished(recipe)
    old = cache.read_manifest(Path(done.data.cache_dir))
    if old is None or data_id(old) != (state.get("identity") or {}).get("data"):
        return []
    try:
        return data_changes(old, done.data, tokenizer_checked(done.model.tokenizer))
    except ConfigError:  # no tokenizer: prepare-data says so
        return []


def missing_outputs(recipe: Recipe) -> list[Path]:
    """The outputs a finished run of ``recipe`` exports that are not there (an export killed or out of space):
    hf/'s config and weight files (with export.merge for LoRA), a LoRA run's adapter/, summary.json. Rank 0 alone writes
    them, so only nodes that see its OUTPUT_DIR look (one node, or data.shared_storage): every node decides alike."""
    run, e = run_dir_of(recipe), recipe.export
    want: list[Path] = []
    unreadable: list[Path] = []
    if recipe.launch.nnodes > 1 and not recipe.data.shared_storage:
        return want
    if e.enabled and recipe.train.method == "lora":
        want += [run.adapter / ADAPTER_CONFIG, run.adapter / ADAPTER_FILE]
    if e.enabled and (recipe.train.method != "lora" or e.merge):
        want.append(run.hf / "config.json")
        index = run.hf / INDEX
        if not index.is_file():
            want.append(run.hf / SINGLE)
        else:
            try:
                want += [run.hf / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                unreadable = [index]  # a torn index: the export did not complete, whatever else is there
    want.append(run.summary)  # written last, after the inference check: the run's end was reached
    return unreadable + [p for p in want if not p.is_file()]


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
