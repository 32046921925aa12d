"""Rank-0 observability: metrics.jsonl and progress lines (summary, plot, TensorBoard: finetune/run/summary.py)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path


def log(msg: str) -> None:
    print(msg, flush=True)


class MetricsWriter:
    """Appends one JSON object per logged step.

    On resume at ``resume_step`` it keeps exactly the records up to that step (a partial line left by
    a crash or a full disk, and records past the checkpoint, are dropped). Starting at step 0 over
    an existing history moves that history aside (``metrics.<time>.jsonl``) and says so.
    """

    def __init__(self, path: Path, resume_step: int, say=log):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        old = read_metrics(path)
        if resume_step == 0 and old:
            kept_as = path.with_name(f"{path.stem}.{time.strftime('%Y%m%d-%H%M%S')}{path.suffix}")
            os.replace(path, kept_as)
            say(f"[train] starting at step 0 over {len(old)} earlier metrics records (to step {old[-1]['step']}): "
                f"they are kept in {kept_as}")
            old = []
        kept = sorted({r["step"]: r for r in old if r["step"] <= resume_step}.values(), key=lambda r: r["step"])
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, path)
        self.records = kept

    def write(self, record: dict) -> None:
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path: Path) -> list[dict]:
    """The complete records of a metrics.jsonl (an unparsable line, e.g. a partial last one, is left out)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and "step" in r:
            out.append(r)
    return out


def progress_line(r: dict, total_steps: int) -> str:
    eta = (total_steps - r["step"]) * r["elapsed_s"] / max(r["step"], 1)
    return (f"step {r['step']:>6}/{total_steps} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | "
            f"grad_norm {r['grad_norm']:.3f} | {r['tokens_per_s']:,.0f} tok/s | "
            f"{r['elapsed_s']:.1f}s elapsed | eta {eta:.0f}s")
