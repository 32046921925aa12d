"""Rank-0 reports from the metric records: TensorBoard scalars while training, summary.json and loss.png at the end.

Records are metrics.jsonl's dicts. Read: ``step``, ``loss``, ``lr``, ``grad_norm``, ``tokens_per_s``
and, when present, ``eval_loss`` (eval records may carry no ``loss``), ``mfu`` (a fraction),
``peak_memory_bytes`` and the step-1 ``memory_*`` fields (to summary.json); every other number goes to
TensorBoard as it is.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from jobspec.config import Recipe
from jobspec.rundir import RunDir

TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "tokens_per_s": "perf/tokens_per_s",
        "mfu": "perf/mfu", "peak_memory_bytes": "perf/peak_memory_bytes"}
NOT_SCALARS = ("step", "elapsed_s")
SMOOTHING = 0.9  # the EMA weight of the smoothed loss (TensorBoard's slider, debiased the same way)


def run_title(recipe: Recipe, tp: int, dp: int, pp: int) -> str:
    """``<model> | TP 2 x DP 4 x PP 1 | recipe <name> | run <output dir name>`` for the plot."""
    model = Path(recipe.model.dir).name if recipe.model.dir else "model"
    return (f"{model} | TP {tp} x DP {dp} x PP {pp} | recipe {recipe.name} | "
            f"run {Path(recipe.output_dir).name}")


def scalars(record: dict) -> dict[str, float]:
    """TensorBoard tag -> value for the numbers in one record."""
    out = {}
    for k, v in record.items():
        if k in NOT_SCALARS or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        out[TAGS.get(k) or (f"eval/{k[5:]}" if k.startswith("eval_") else f"train/{k}")] = float(v)
    return out


def smooth(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """Debiased exponential moving average (the first points are not pulled towards 0)."""
    out, acc = [], 0.0
    for i, v in enumerate(values, 1):
        acc = weight * acc + (1 - weight) * v
        out.append(acc / (1 - weight**i))
    return out


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` where it is a finite number: a skipped step's non-finite loss is no point of a
    curve, and summary.json stays strict JSON (no NaN)."""
    rs = [r for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [r["step"] for r in rs], [float(r[key]) for r in rs]


def memory_at_step_1(records: list[dict]) -> dict:
    """The step-1 memory record's fields (finetune/run/memcheck.py): the measured peak beside the plan's estimate."""
    first = next((r for r in records if "memory_estimate_bytes" in r), {})
    return {k: v for k, v in first.items() if k.startswith("memory_")}


def summary(records: list[dict], tokens: int, wall_s: float, last_checkpoint: str | None = None,
            export_path: str | None = None, peak_memory_bytes: int | None = None) -> dict:
    """The end-of-run numbers; peak memory from the argument, else the records' maximum."""
    steps, loss = _series(records, "loss")
    eval_steps, eval_loss = _series(records, "eval_loss")
    _, mfu = _series(records, "mfu")
    _, mem = _series(records, "peak_memory_bytes")
    best = min(range(len(eval_loss)), key=eval_loss.__getitem__) if eval_loss else None
    low = min(range(len(loss)), key=loss.__getitem__) if loss else None
    return {
        "steps": max((r["step"] for r in records), default=0), "tokens": tokens,
        "first_loss": loss[0] if loss else None, "last_loss": loss[-1] if loss else None,
        "min_loss": loss[low] if low is not None else None, "min_loss_step": steps[low] if low is not None else None,
        "best_eval_loss": eval_loss[best] if best is not None else None,
        "best_eval_step": eval_steps[best] if best is not None else None,
        "mean_mfu": sum(mfu) / len(mfu) if mfu else None,
        "peak_memory_bytes": peak_memory_bytes if peak_memory_bytes is not None else (int(max(mem)) if mem else None),
        **memory_at_step_1(records),
        "last_checkpoint": last_checkpoint, "export_path": export_path, "wall_time_s": round(wall_s, 2),
    }


def summarize(records: list[dict], run: RunDir, tokens: int, wall_s: float, title: str = "training run",
              **extra) -> dict:
    """Write summary.json and loss.png; return the summary (``extra``: see :func:`summary`)."""
    s = summary(records, tokens, wall_s, **extra)
    run.summary.write_text(json.dumps(s, indent=1, allow_nan=False))
    if records:
        plot(records, run.loss_plot, title)
    return s


def plot(records: list[dict], path: Path, title: str) -> None:
    """loss.png: loss (raw, smoothed, eval) | lr | grad norm | tokens/s with MFU; panels without data say so."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the summary still stands without a picture
        print("matplotlib is not installed: no loss.png", file=sys.stderr)
        return
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    (ax_loss, ax_lr), (ax_gn, ax_tps) = axes
    steps, loss = _series(records, "loss")
    ax_loss.plot(steps, loss, color="tab:blue", alpha=0.35, lw=1, label="train (raw)")
    ax_loss.plot(steps, smooth(loss), color="tab:blue", lw=2, label=f"train (EMA {SMOOTHING})")
    eval_steps, eval_loss = _series(records, "eval_loss")
    if eval_loss:
        ax_loss.plot(eval_steps, eval_loss, color="tab:orange", marker="o", lw=1.5, label="eval")
    ax_loss.set_ylabel("loss")
    ax_loss.legend(loc="upper right", fontsize=8)
    for ax, key, label in ((ax_lr, "lr", "learning rate"), (ax_gn, "grad_norm", "grad norm"),
                           (ax_tps, "tokens_per_s", "tokens/s")):
        xs, ys = _series(records, key)
        ax.plot(xs, ys, color="tab:green", lw=1.5)
        ax.set_ylabel(label)
        if not ys:
            ax.text(0.5, 0.5, f"no {key} recorded", transform=ax.transAxes, ha="center", color="gray")
    mfu_steps, mfu = _series(records, "mfu")
    if mfu:
        twin = ax_tps.twinx()
        twin.plot(mfu_steps, [100 * m for m in mfu], color="tab:red", lw=1.5)
        twin.set_ylabel("MFU %", color="tab:red")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class RunSummary:
    """What the loop calls on rank 0: :meth:`write` per logged record, :meth:`close` once at the end.

    TensorBoard event files go to ``run.tensorboard`` unless ``tensorboard`` is False
    (``train.tensorboard``). On resume, events past ``resume_step`` from the earlier run are purged.
    """

    def __init__(self, run: RunDir, title: str, tensorboard: bool = True, resume_step: int = 0):
        self.run, self.title = run, title
        self.tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            # the event file is named by the second it was opened: a writer opened in the same second
            # as the last one would truncate its file; the nanosecond suffix keeps both, in order
            self.tb = SummaryWriter(str(run.tensorboard), flush_secs=30,
                                   filename_suffix=f".{time.time_ns()}",
                                    purge_step=resume_step + 1 if resume_step else None)

    def write(self, record: dict) -> None:
        if self.tb is not None:
            for tag, value in scalars(record).items():
                self.tb.add_scalar(tag, value, record["step"])

    def close(self, records: list[dict], tokens: int, wall_s: float, **extra) -> dict:
        """Flush TensorBoard, write summary.json and loss.png; ``extra``: see :func:`summary`."""
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        return summarize(records, self.run, tokens, wall_s, self.title, **extra)
