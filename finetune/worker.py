"""Worker entry point: what msrun starts in every rank (and, with MS_ROLE=MS_SCHED, as its scheduler).

    python finetune/worker.py --config <plan.json | recipe.json>

Reads only its config (the resolved recipe, the run directory's paths and the base model's identity:
``recipe``, ``run_dir`` and ``model_hash`` in plan.json) and the rank environment. Dies with its parent
(msrun or the launcher); a training rank records its start and end in the run's ``logs/ranks/``
(jobspec/lifecycle.py). Started without the launcher on a finished run, it says so and exits 0 as the
launcher does (jobspec/rerun.py).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # started as a script by msrun
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from finetune.affinity import apply_binding
from jobspec.checkpoint_index import tidy
from jobspec.config import ConfigError, Recipe
from jobspec.lifecycle import LAUNCHER_PID_ENV, die_with_parent, run_rank
from jobspec.plan_reader import load_run
from jobspec.rerun import rerun_answer
from jobspec.rundir import RunDir


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    apply_binding()  # the launcher's per-rank CPU/NUMA plan (may re-exec under numactl)
    ap = argparse.ArgumentParser(prog="finetune.worker")
    ap.add_argument("--config", required=True, help="plan.json or a resolved recipe JSON")
    args = ap.parse_args(argv)
    try:
        recipe, run_dir, model_hash = load_run(args.config)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    if LAUNCHER_PID_ENV not in os.environ:  # started by hand: what the launcher does before its workers
        answer = rerun_answer(recipe, "worker")
        if answer is not None:
            return answer
        if os.environ.get("RANK_ID", "0") == "0" and os.environ.get("MS_ROLE") != "MS_SCHED":
            tidy(run_dir, recipe.train.resume == "never", lambda line: print(f"[worker] {line}"))
    if os.environ.get("MS_ROLE") == "MS_SCHED":
        return _train(recipe, run_dir, model_hash)
    return run_rank(run_dir.logs, int(os.environ.get("RANK_ID", "0")), lambda: _train(recipe, run_dir, model_hash))


def _train(recipe: Recipe, run_dir: RunDir, model_hash: str) -> int:
    from jobspec.native import mindspore_mismatch

    mismatch = mindspore_mismatch()  # an x86-64 wheel on an aarch64 host fails in import, unexplained
    if mismatch:
        print(f"[worker] {mismatch}", file=sys.stderr)
        return 2
    from finetune.run.loop import run  # imports mindspore

    return run(recipe, run_dir, model_hash)


if __name__ == "__main__":
    sys.exit(main())
