"""Rank-0 observability: metrics.jsonl and progress lines (summary, plot, TensorBoard: finetune/report.py)."""
from __future__ import annotations

import json
from pathlib import Path


def log(msg: str) -> None:
    print(msg, flush=True)


class MetricsWriter:
    """Appends one JSON object per logged step; on resume drops entries past the resumed step."""

    def __init__(self, path: Path, resume_step: int):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(path) if r["step"] <= resume_step] if resume_step else []
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self.records = kept

    def write(self, record: dict) -> None:
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def progress_line(r: dict, total_steps: int) -> str:
    eta = (total_steps - r["step"]) * r["elapsed_s"] / max(r["step"], 1)
    return (f"step {r['step']:>6}/{total_steps} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | "
            f"grad_norm {r['grad_norm']:.3f} | {r['tokens_per_s']:,.0f} tok/s | "
            f"{r['elapsed_s']:.1f}s elapsed | eta {eta:.0f}s")
