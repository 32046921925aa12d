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
from typing import Any, NamedTuple

from jobspec.checkpoint_index import STATE, data_id, usable, ways_out
from jobspec.config import DataConfig
from jobspec.data import cache
from jobspec.data.files import DataError, resolve_sources
from jobspec.fsutil import file_hash
from jobspec.rundir import RunDir


class RunDataChanged(DataError):
    """The recipe's data differs from the data the run in OUTPUT_DIR trained; nothing was written."""


class Resumed(NamedTuple):
    """The run in ``output_dir`` and the ``checkpoint`` its ``train.resume`` would continue (None: none)."""

    output_dir: str
    checkpoint: Path | None

    @classmethod
    def of(cls, run: RunDir, resume: str) -> Resumed:
        """``train.resume``'s checkpoint in ``run``: the one it names, with auto the newest usable one, never: none."""
        if resume != "auto":
            return cls(str(run.root), None if resume == "never" else Path(resume))
        found = usable(run.checkpoints, log=lambda _: None)
        return cls(str(run.root), found[0] if found else None)


def _sources_now(data: DataConfig) -> list[dict[str, Any]]:
    return [cache.source_entry(s, with_hash=False) for s in resolve_sources(data) + resolve_sources(data, val=True)]


def data_changes(old: dict[str, Any], data: DataConfig, tokenizer_path: str | Path) -> list[str]:
    """What differs between the cache manifest ``old`` and ``data`` with this tokenizer, one phrase each."""
    changes = []
    was, now = old.get("settings", {}), cache.settings_of(data, tokenizer_path)
    for key in sorted(set(was) | set(now)):
        if was.get(key) != now.get(key):
            changes.append("the tokenizer (tokenizer.json of the model) changed" if key == "tokenizer_sha256" else
                           f"data.{key} was {was.get(key)!r}, now {now.get(key)!r}")
    before, after = old.get("sources", []), _sources_now(data)
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


def check_same_data(data: DataConfig, cache_dir: Path, tokenizer_path: str | Path, resumed: Resumed | None) -> None:
    """Raise :class:`RunDataChanged` when rebuilding the cache in ``cache_dir`` would change the data of the
    checkpoint that ``resumed`` continues; call it only when the cache is not fresh."""
    ckpt = resumed.checkpoint if resumed else None
    old = cache.read_manifest(cache_dir)
    if resumed is None or ckpt is None or old is None:
        return
    try:
        trained = json.loads((ckpt / STATE).read_text()).get("identity", {}).get("data")
    except (OSError, ValueError):
        return  # a damaged checkpoint: the worker skips it with the reason
    if trained != data_id(old):
        return  # the cache is not the one the checkpoint trained: nothing of the run is lost by rebuilding it
    changes = data_changes(old, data, tokenizer_path)
    if changes:
        raise RunDataChanged(f"{resumed.output_dir} holds a run trained on other data (checkpoint {ckpt.name}): "
                             + "; ".join(changes) + f". Nothing was written. {ways_out(resumed.output_dir)}")
