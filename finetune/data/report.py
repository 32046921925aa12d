"""data_report.json and the console table: what was kept, dropped and why, lengths, efficiency."""
from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

from finetune.config import Recipe
from finetune.data import batching
from finetune.data.formats import Sample

class Progress:
    """The progress line on stderr (every 0.5 s on a terminal, else every 10 s)."""

    def __init__(self, enabled: bool):
        self.enabled, self.t0, self.last = enabled, time.monotonic(), 0.0

    def update(self, n: int, tokens: int, final: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not final and now - self.last < (0.5 if sys.stderr.isatty() else 10)):
            return
        self.last = now
        dt = max(now - self.t0, 1e-9)
        end = "\n" if final or not sys.stderr.isatty() else "\r"
        print(f"prepare-data: {n:,} samples  {tokens:,} tokens  {n / dt:,.0f} samples/s  "
              f"{tokens / dt:,.0f} tokens/s", end=end, file=sys.stderr, flush=True)


def example(s: Sample) -> dict:
    answer = next((c for r, c in reversed(s.turns) if r == "assistant"), "")
    prompt = next((c for r, c in reversed(s.turns) if r == "user"), "")
    return {"where": s.where, "prompt": prompt[:120], "response": answer[:120]}


def make_report(recipe: Recipe, lengths: np.ndarray, n_read: int, n_unique: int, dropped: dict,
                truncated: int, elapsed: float, n_tokens: int) -> dict:
    """data_report.json content: counts per rule, length percentiles, batching efficiency."""
    cfg = recipe.data
    pct = {f"p{q}": int(np.percentile(lengths, q)) for q in (50, 90, 95, 99)} if len(lengths) else {}
    eff: dict[str, Any] = {"seq_len": cfg.seq_len}
    if len(lengths):
        rows = batching.pack_ffd(lengths, cfg.seq_len)
        eff["packed_rows"] = len(rows)
        eff["packing"] = round(float(lengths.sum()) / (len(rows) * cfg.seq_len), 4)
        eff["padding"] = round(float(lengths.mean()) / cfg.seq_len, 4)
        if cfg.max_tokens_per_batch:
            groups = batching.group_by_budget(lengths, cfg.max_tokens_per_batch)
            eff["dynamic"] = round(batching.efficiency(groups, lengths), 4)
            eff["dynamic_batches"] = len(groups)
    return {"samples_read": n_read, "samples_kept": n_unique, "index_entries": int(len(lengths)),
            "tokens": n_tokens, "truncated": truncated,
            "dropped": {k: v for k, v in dropped.items() if v["count"]},
            "token_length": {"mean": round(float(lengths.mean()), 1) if len(lengths) else 0, **pct,
                             "max": int(lengths.max()) if len(lengths) else 0},
            "efficiency": eff, "elapsed_s": round(elapsed, 2),
            "samples_per_s": round(n_read / max(elapsed, 1e-9), 1),
            "tokens_per_s": round(n_tokens / max(elapsed, 1e-9), 1)}


def format_report(report: dict) -> str:
    """The console table."""
    lines = [f"{'rule':<16}{'dropped':>9}  example",
             "-" * 72]
    for rule, d in report.get("dropped", {}).items():
        ex = d["examples"][0] if d["examples"] else {}
        lines.append(f"{rule:<16}{d['count']:>9}  {ex.get('where', '')}")
    lines += ["-" * 72,
              f"{'kept':<16}{report['samples_kept']:>9}  of {report['samples_read']} read; "
              f"{report['index_entries']} after weights, {report['truncated']} truncated, {report['tokens']:,} tokens"]
    tl = report["token_length"]
    lines.append("tokens/sample   " + "  ".join(f"{k} {v}" for k, v in tl.items()))
    eff = report["efficiency"]
    lines.append("efficiency      " + "  ".join(f"{k} {v}" for k, v in eff.items()))
    lines.append(f"speed           {report['samples_per_s']:,} samples/s  {report['tokens_per_s']:,} tokens/s "
                 f"({report['elapsed_s']} s)")
    return "\n".join(lines)
