"""``finetune/worker.py`` that records, at each checkpoint save and export, how many of this rank's decoder-layer
weights are whole (not ZeRO-3's one-element placeholders), and at each ZeRO-3 gather how many layers this rank
already held: one JSON line per event in ``held_rank<RANK_ID>.jsonl`` of the working directory (the run's)."""
from __future__ import annotations

import json
import os
import sys
from functools import wraps
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import numpy as np

import finetune.io.hf_io as hf_io
import finetune.run.training as training
from finetune import worker
from finetune.parallel.zero3 import ShardedWeights

LOG = Path.cwd() / f"held_rank{os.environ.get('RANK_ID', '0')}.jsonl"


def _record(**event) -> None:
    with LOG.open("a") as f:
        f.write(json.dumps(event) + "\n")


def _whole(named: list[tuple[str, object]]) -> dict:
    layers = [p for n, p in named if ".layers." in n]
    return {"layer_weights": len(layers), "whole": sum(int(np.prod(p.shape)) > 1 for p in layers)}


def _watch(what: str, fn, named):
    @wraps(fn)
    def call(*args, **kwargs):
        _record(event=what, **_whole(named(*args)))
        return fn(*args, **kwargs)
    return call


training.save_checkpoint = _watch("save", training.save_checkpoint, lambda *a: [(p.name, p) for p in a[2]])
hf_io.export_hf = _watch("export", hf_io.export_hf, lambda *a: list(a[0].hf_state().items()))
_gather_layer = ShardedWeights._gather


def _gather(self, n: int) -> None:
    _record(event="gather", held=len(self.held))
    _gather_layer(self, n)


ShardedWeights._gather = _gather

if __name__ == "__main__":
    sys.exit(worker.main())
