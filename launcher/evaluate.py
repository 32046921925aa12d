"""``ascend-finetune eval`` (``make eval``): the run's base model and its ``hf/`` export on the tasks of ``eval.tasks``
(``EVAL_TASKS``) with the benchmark files of ``eval.data_dir`` (``EVAL_DATA``), side by side, into
``OUTPUT_DIR/eval/``; the before/after table also goes into the run's ``summary.json`` under ``eval``.

The worker side is ``finetune/eval`` (started as a process: the launcher never imports it).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jobspec.config import REPO_ROOT, Recipe, resolved_model_dir
from jobspec.rundir import EVAL_FILES, run_dir_of
from launcher import launch

HELP = "score the base model and the hf/ export on lm-eval's tasks (EVAL_TASKS, EVAL_DATA) into OUTPUT_DIR/eval"
TOOL = REPO_ROOT / "finetune/eval/__main__.py"  # the package, not the run directory's eval/


def eval_argv(r: Recipe, models: dict[str, str]) -> list[str]:
    """The evaluator's command line for ``models`` (label -> directory) from the recipe's ``eval`` section."""
    c = r.eval
    argv = [sys.executable, str(TOOL), "--data-dir", c.data_dir, "--out", str(run_dir_of(r).eval),
            "--tasks", ",".join(c.tasks), "--num-fewshot", str(c.num_fewshot), "--batch-size", str(c.batch_size),
            "--limit", str(c.limit), "--max-gen-toks", str(c.max_gen_toks), "--device", r.launch.device,
            "--tp", str(r.parallel.tp_size)]
    argv += ["--apply-chat-template"] if c.apply_chat_template else []
    argv += ["--fewshot-as-multiturn" if c.fewshot_as_multiturn else "--no-fewshot-as-multiturn"]
    argv += ["--reuse", "base"]  # the base model's results stay valid while its settings do
    return argv + [a for label, d in models.items() for a in ("--model", f"{label}={d}")]


def models_of(r: Recipe) -> dict[str, str]:
    """base: the run's base model; hf: its export, where one exists."""
    hf = run_dir_of(r).hf
    return {"base": resolved_model_dir(r), **({"hf": str(hf)} if (hf / "config.json").is_file() else {})}


def merge_summary(r: Recipe) -> None:
    """Put ``eval/summary.json`` into the run's ``summary.json`` (key ``eval``) when the run wrote one."""
    run = run_dir_of(r)
    run_summary, ours = run.summary, run.eval / EVAL_FILES["summary"]
    if run_summary.is_file() and ours.is_file():
        data: dict[str, Any] = json.loads(run_summary.read_text())
        data["eval"] = json.loads(ours.read_text())
        tmp = run_summary.with_name(run_summary.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, run_summary)


def after_training(train: Callable[[Any, Any, Any], int]) -> Callable[[Any, Any, Any], int]:
    """``train``, then on node 0 with ``eval.after_training`` the evaluation of export and base (its results
    reused while the settings are the same), so the run's summary.json says what the fine-tune changed."""
    def run(job: Any, args: Any, host: Any) -> int:
        rc = train(job, args, host)
        r = job.recipe
        if rc != 0 or not r.eval.after_training or r.launch.node_rank != 0 or r.launch.dry_run:
            return rc
        print("[launcher] eval.after_training: scoring the export and the base model", flush=True)
        return cmd_eval(job)
    return run


def cmd_eval(job: Any, args: Any = None, host: Any = None) -> int:
    """``eval``: the job's workers (one, or msrun's world: each rank a share of the requests) score base and export;
    exit 2 naming EVAL_DATA when no benchmark folder is set."""
    r: Recipe = job.recipe
    if not r.eval.data_dir:
        print("[launcher] eval.data_dir (EVAL_DATA) is not set: the folder with one subfolder per task in its "
              "published layout (docs/evaluation.md), e.g. EVAL_DATA=/data/benchmarks", file=sys.stderr)
        return 2
    models = models_of(r)
    if "hf" not in models:
        print(f"[launcher] eval: no export at {run_dir_of(r).hf} yet; evaluating the base model only", flush=True)
    argv = eval_argv(r, models)
    if job.world > 1:  # msrun starting the evaluator with its options on every worker
        L = r.launch
        argv = launch.msrun_argv(job.world, job.nproc, L.master_addr, L.master_port, L.node_rank, L.cluster_time_out,
                                 Path(), run_dir_of(r).eval / EVAL_FILES["logs"], TOOL, worker_args=argv[2:])
    rc = subprocess.call(argv, env=job.env)
    if rc == 0:
        merge_summary(r)
    return rc
