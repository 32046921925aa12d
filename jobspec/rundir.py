"""Every path of a run directory (``OUTPUT_DIR``) in one place, and the checkpoint-complete rule.

Pure Python (the launcher imports it). The README's output table is generated from :data:`ENTRIES`
(``tests/finetune/test_rundir.py`` checks that they are equal).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"  # a checkpoint's file list, written last: its presence marks a complete checkpoint

# (attribute, path under OUTPUT_DIR, what it holds): the README's output table, in its order
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
    ("samples", "samples.jsonl", "the exported model's answers to the held-out check prompts (`export.check_prompts`)"),
    ("summary", "summary.json", "the run's numbers (see \"Monitoring a run\")"),
    ("loss_plot", "loss.png", "its curves"),
    ("tensorboard", "tensorboard/", "TensorBoard scalar event files (`train.tensorboard: false` turns them off)"),
    ("logs", "logs/", "each worker's log and `ranks/rank_N.json` (pid, host, exit code, error and its traceback)"),
    ("npu_log", "npu.jsonl", "`npu-smi` samples per NPU: health, temperature, power, AICore %, HBM (node N > 0: "
                             "`npu-nodeN.jsonl`; only with NPUs)"),
    ("profile", "profile/", "the profiler's trace of `train.profile_steps`"),
    ("lock", ".lock", "one job per `OUTPUT_DIR`: a running job's pid, host and start time; emptied, not removed, when "
                      "it ends (node N > 0: `.lock.nodeN`)"),
    ("hashes", ".model-hashes.json", "the sha256 of each base model weight file by path, size and mtime (the run's "
                                     "model identity): a rerun reads only files changed since"),
)


@dataclass(frozen=True)
class RunDir:
    """The paths of the run in ``root``; ``RunDir(output_dir).hf`` etc."""

    root: Path

    def __init__(self, root: str | Path):
        object.__setattr__(self, "root", Path(root))

    def _at(self, attr: str) -> Path:
        rel = next(p for a, p, _ in ENTRIES if a == attr)
        return self.root / rel.split("/")[0]

    plan = property(lambda self: self._at("plan"))
    base_model = property(lambda self: self._at("base_model"))
    data = property(lambda self: self._at("data"))
    metrics = property(lambda self: self._at("metrics"))
    checkpoints = property(lambda self: self._at("checkpoints"))
    hf = property(lambda self: self._at("hf"))
    samples = property(lambda self: self._at("samples"))
    summary = property(lambda self: self._at("summary"))
    loss_plot = property(lambda self: self._at("loss_plot"))
    tensorboard = property(lambda self: self._at("tensorboard"))
    logs = property(lambda self: self._at("logs"))
    profile = property(lambda self: self._at("profile"))
    lock = property(lambda self: self._at("lock"))
    hashes = property(lambda self: self._at("hashes"))

    def npu_log(self, node_rank: int = 0) -> Path:
        return self._at("npu_log") if node_rank == 0 else self.root / f"npu-node{node_rank}.jsonl"

    def checkpoint(self, step: int) -> Path:
        return self._at("checkpoints") / step_name(step)

    def export(self, checkpoint: Path) -> Path:
        """Where ``export`` writes a checkpoint by default: ``hf-step_N`` beside ``hf/``."""
        return self.root / f"hf-{checkpoint.name}"


def step_name(step: int) -> str:
    """A checkpoint directory's name: ``step_00000030``."""
    return f"step_{step:08d}"


def is_complete(checkpoint: Path) -> bool:
    """A published checkpoint: renamed from ``step_N.tmp`` and holding its manifest (written last)."""
    return checkpoint.suffix != ".tmp" and (checkpoint / MANIFEST).is_file()


def readme_table() -> str:
    """The README's table of a run directory's contents."""
    rows = [f"| `{path}` | {what} |" for _, path, what in ENTRIES]
    return "\n".join(["| file | what |", "|---|---|", *rows])
