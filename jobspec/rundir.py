"""Every path of a run directory (``OUTPUT_DIR``) in one place, and the checkpoint-complete rule.

Pure Python (the launcher imports it). docs/training.md's output table is generated from :data:`ENTRIES`
(``tests/finetune/test_rundir.py`` checks that they are equal).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

EVAL_FILES = {"summary": "summary.json", "tensorboard": "tensorboard", "logs": "logs"}  # under eval/
MANIFEST = "manifest.json"  # a checkpoint's file list, written last: its presence marks a complete checkpoint

# (attribute, path under OUTPUT_DIR, what it holds): docs/training.md's output table, in its order
ENTRIES = (
    ("plan", "plan.json", "the resolved recipe, topology, ranks, NUMA binding, memory estimate and msrun argv"),
    ("base_model", "base-model/", "the created tiny model of the embedded default (only without `MODEL_DIR`)"),
    ("data", "data/", "the token cache and `data_report.json` (kept/dropped per cleaning rule, lengths, packing "
                      "efficiency); `data.cache_dir` moves it"),
    ("metrics", "metrics.jsonl", "one JSON object per logged step: `step`, `loss`, `lr`, `grad_norm`, "
                                 "`tokens_per_s`, `elapsed_s`"),
    ("checkpoints", "checkpoints/step_N/", "resumable checkpoints (weights, optimizer state, data position), "
                                           "written atomically"),
    ("hf", "hf/", "the fine-tuned model in Hugging Face layout (directories 0755, files 0644: a non-root server "
                  "can read it)"),
    ("adapter", "adapter/", "with `train.method: lora`: the trained adapter in PEFT's layout (`hf/` then holds the "
                            "merged model, `export.merge`)"),
    ("samples", "samples.jsonl", "the exported model's answers to the held-out check prompts (`export.check_prompts`)"),
    ("summary", "summary.json", "the run's numbers (docs/monitoring.md)"),
    ("loss_plot", "loss.png", "its curves"),
    ("tensorboard", "tensorboard/", "TensorBoard scalar event files (`train.tensorboard: false` turns them off)"),
    ("logs", "logs/", "each worker's log and `ranks/rank_N.json` (pid, host, exit code, error and its traceback)"),
    ("npu_log", "npu.jsonl", "`npu-smi` samples per NPU: health, temperature, power, AICore %, HBM (node N > 0: "
                             "`npu-nodeN.jsonl`; only with NPUs)"),
    ("profile", "profile/", "the profiler's trace of `train.profile_steps`"),
    ("eval", "eval/", "`make eval`'s results: `<model>.json` per model, `samples_<task>.jsonl`, `summary.json` (the "
                      "before/after table, also under `eval` in the run's `summary.json`), `tensorboard/`, `logs/`"),
    ("lock", ".lock", "one job per `OUTPUT_DIR`: a running job's pid, host and start time; emptied, not removed, when "
                      "it ends (node N > 0: `.lock.nodeN`)"),
    ("hashes", ".model-hashes.json", "the sha256 of each base model weight file by path, size and mtime (the run's "
                                     "model identity): a rerun reads only files changed since"),
)


class _Entry:
    """A path of :data:`ENTRIES` as a typed attribute of :class:`RunDir`, named by the attribute."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, run: RunDir, owner: type | None = None) -> Path:
        return run._at(self.name)


@dataclass(frozen=True)
class RunDir:
    """The paths of the run in ``root``; ``RunDir(output_dir).hf`` etc. ``data``: the token cache
    (``data.cache_dir``, default ``<root>/data``). The launcher decides it and writes it into plan.json
    (:meth:`to_json`); the workers read it back (:meth:`from_json`)."""

    root: Path
    data: Path

    def __init__(self, root: str | Path, data: str | Path | None = None):
        object.__setattr__(self, "root", Path(root))
        object.__setattr__(self, "data", Path(data) if data else self._at("data"))

    def _at(self, attr: str) -> Path:
        rel = next(p for a, p, _ in ENTRIES if a == attr)
        return self.root / rel.split("/")[0]

    def to_json(self) -> dict[str, str]:
        """plan.json's ``run_dir``: the root, the token cache, and every other path (for the reader)."""
        return {"root": str(self.root), "data": str(self.data),
                **{a: str(self.npu_log() if a == "npu_log" else getattr(self, a))
                   for a, _, _ in ENTRIES if a not in ("data", "lock")}}

    @classmethod
    def from_json(cls, d: dict[str, str]) -> RunDir:
        return cls(d["root"], d["data"])

    plan = _Entry()
    base_model = _Entry()
    metrics = _Entry()
    checkpoints = _Entry()
    hf = _Entry()
    adapter = _Entry()
    samples = _Entry()
    summary = _Entry()
    loss_plot = _Entry()
    tensorboard = _Entry()
    logs = _Entry()
    profile = _Entry()
    eval = _Entry()
    hashes = _Entry()

    def npu_log(self, node_rank: int = 0) -> Path:
        return self._at("npu_log") if node_rank == 0 else self.root / f"npu-node{node_rank}.jsonl"

    def lock(self, node_rank: int = 0) -> Path:
        """The job lock of node ``node_rank`` (-1: an AscendJob Scheduler pod's)."""
        return self._at("lock") if node_rank == 0 else self.root / f".lock.node{node_rank}"

    @property
    def temp_parents(self) -> tuple[Path, Path, Path]:
        """Where an interrupted export, save or prepare leaves its ``.<name>.tmp-<host>-<pid>`` directories."""
        return self.root, self.checkpoints, self.data.parent

    def checkpoint(self, step: int) -> Path:
        return self._at("checkpoints") / step_name(step)

    def export(self, checkpoint: Path) -> Path:
        """Where ``export`` writes a checkpoint by default: ``hf-step_N`` beside ``hf/``."""
        return self.root / f"hf-{checkpoint.name}"


class _DataSection(Protocol):
    @property
    def cache_dir(self) -> str: ...


class _Recipe(Protocol):  # jobspec.config.Recipe, which imports this module
    @property
    def output_dir(self) -> str: ...
    @property
    def data(self) -> _DataSection: ...


def run_dir_of(recipe: _Recipe) -> RunDir:
    """The one rule from a recipe to its run directory: ``output_dir``, the token cache moved by
    ``data.cache_dir``. The launcher applies it; the workers read its result from plan.json."""
    return RunDir(recipe.output_dir, recipe.data.cache_dir or None)


def step_name(step: int) -> str:
    """A checkpoint directory's name: ``step_00000030``."""
    return f"step_{step:08d}"


def step_dirs(checkpoints: Path) -> list[Path]:
    """The checkpoint directories under ``checkpoints`` (complete, ``.tmp`` or broken), by name: oldest first."""
    return sorted(checkpoints.glob("step_*"))


def is_complete(checkpoint: Path) -> bool:
    """A published checkpoint: renamed from ``step_N.tmp`` and holding its manifest (written last)."""
    return checkpoint.suffix != ".tmp" and (checkpoint / MANIFEST).is_file()


def readme_table() -> str:
    """docs/training.md's table of a run directory's contents."""
    rows = [f"| `{path}` | {what} |" for _, path, what in ENTRIES]
    return "\n".join(["| file | what |", "|---|---|", *rows])
