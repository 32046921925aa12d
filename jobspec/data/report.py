"""data_report.json and the console table: what was kept, dropped and why, lengths, efficiency."""
from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
from numpy.typing import NDArray

from jobspec.config import DataConfig
from jobspec.data import batching
from jobspec.data.formats import Sample, is_text


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


# one line per figure: data_report.json carries them ("meaning") and the console table prints them
RULE_MEANING = {
    "invalid_utf8": "bytes that are not UTF-8 (data.clean.invalid_utf8)",
    "role_order": "turns out of order: not user, assistant, user, ... (an answer first, or two questions in a row)",
    "empty_response": "an empty answer, or an empty document",
    "repeat_prompt": "the answer repeats its prompt",
    "repeated_chars": "one character repeated more than data.clean.repeated_chars_max_run times",
    "mojibake": "too many control / replacement / private-use characters",
    "too_short": "fewer tokens than data.clean.min_tokens",
    "too_long": "more tokens than data.clean.max_tokens",
    "cannot_fit": "the last answer does not fit data.seq_len even with earlier turns and the prompt cut",
    "dedup": "a repeat of an earlier sample (the first is kept)",
    "no_labels": "nothing left to learn after truncation",
    "malformed": "records that could not be read (data.on_error=skip; the error is in the examples)",
}
MEANING = {
    "samples_read": "records read from the data files",
    "samples_kept": "samples stored after the cleaning rules and dedup (each once; a split document counts per piece)",
    "index_entries": "training samples per epoch: the kept ones repeated or thinned by data.weights",
    "tokens": "tokens stored (kept samples, templated)",
    "label_tokens": "tokens the loss is computed on per epoch (assistant answers and tool calls; all of plain text)",
    "truncated": "samples longer than data.seq_len kept by dropping early turns or cutting the prompt's start",
    "split_documents": "plain-text documents longer than data.seq_len, split into data.seq_len pieces",
    "ended_on_user": "conversations ending on a user or tool turn: those last turns are dropped (nothing answers them)",
    "dropped": "samples dropped, per rule (meaning under rules), with up to 3 examples",
    "token_length": "tokens per training sample (templated): mean, percentiles, max",
    "efficiency.packed_rows": "rows of data.seq_len tokens per epoch with packing",
    "efficiency.packing": "share of token slots holding real tokens when samples are packed into rows (1 = no padding)",
    "efficiency.padding": "the same share with one sample per row (data.packing=false): the rest is padding",
    "efficiency.dynamic": "the same share with batches by token budget (data.max_tokens_per_batch)",
    "validation": "samples held out for the eval loss (data.val_size) or read from data.val_paths",
    "speed": "samples and tokens prepared per second, end to end",
}


def example(s: Sample, tokens: int | None = None) -> dict[str, Any]:
    """A dropped sample as the report shows it (where it is, its start, its length in tokens)."""
    if is_text(s):
        out = {"where": s.where, "text": s.turns[0][1][:120]}
    else:
        answer = next((c for r, c in reversed(s.turns) if r == "assistant"), "")
        prompt = next((c for r, c in reversed(s.turns) if r == "user"), "")
        out = {"where": s.where, "prompt": prompt[:120], "response": answer[:120]}
    return {**out, "tokens": tokens} if tokens is not None else out


def _labels(index: NDArray[Any]) -> int:
    return int(index[:, 2].sum() + index[:, 3].sum())


def make_report(cfg: DataConfig, build: Any, index: NDArray[Any], val: NDArray[Any], elapsed: float) -> dict[str, Any]:
    """data_report.json content: counts per rule, length percentiles, batching efficiency, validation,
    and the meaning of each figure."""
    lengths = index[:, 1]
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
    rep = {"samples_read": build.n_read, "samples_kept": build.n_unique, "index_entries": int(len(lengths)),
           "tokens": build.offset, "label_tokens": _labels(index), "truncated": build.truncated,
           "split_documents": build.split, "ended_on_user": build.tails,
           "dropped": {k: v for k, v in build.dropped.items() if v["count"]},
           "token_length": {"mean": round(float(lengths.mean()), 1) if len(lengths) else 0, **pct,
                            "max": int(lengths.max()) if len(lengths) else 0},
           "efficiency": eff, "elapsed_s": round(elapsed, 2),
           "samples_per_s": round(build.n_read / max(elapsed, 1e-9), 1),
           "tokens_per_s": round(build.offset / max(elapsed, 1e-9), 1)}
    if len(val):
        rep["validation"] = {"samples": int(len(val)), "tokens": int(val[:, 1].sum()), "label_tokens": _labels(val),
                             "from": f"data.val_size={cfg.val_size}" if cfg.val_size else "data.val_paths"}
    rep["meaning"] = {**MEANING, **{f"dropped.{k}": v for k, v in RULE_MEANING.items() if k in rep["dropped"]}}
    return rep


def format_report(report: dict[str, Any]) -> str:
    """The console table: each figure with its meaning."""
    meaning = {**MEANING, **report.get("meaning", {})}
    lines = [f"{'rule':<16}{'dropped':>9}  meaning; first example", "-" * 100]
    for rule, d in report.get("dropped", {}).items():
        ex = d["examples"][0] if d["examples"] else {}
        where = ex.get("where", ex.get("error", ""))[-60:] + (f" ({ex['tokens']} tokens)" if "tokens" in ex else "")
        lines.append(f"{rule:<16}{d['count']:>9}  {RULE_MEANING.get(rule, '')}; {where}")
    lines.append("-" * 100)

    def row(name: str, value: Any, key: str) -> None:
        lines.append(f"{name:<16}{value:>9}  {meaning.get(key, '')}")

    row("read", f"{report['samples_read']:,}", "samples_read")
    row("kept", f"{report['samples_kept']:,}", "samples_kept")
    row("per epoch", f"{report['index_entries']:,}", "index_entries")
    for key in ("truncated", "split_documents"):
        if report.get(key):
            row(key.replace("_", " "), f"{report[key]:,}", key)
    ended = report.get("ended_on_user", {}).get("count", 0)
    if ended:
        row("ended on user", f"{ended:,}", "ended_on_user")
    row("tokens", f"{report['tokens']:,}", "tokens")
    if "label_tokens" in report:
        row("label tokens", f"{report['label_tokens']:,}", "label_tokens")
    if "validation" in report:
        v = report["validation"]
        row("validation", f"{v['samples']:,}", "validation")
        lines[-1] += f" ({v['from']}; {v['label_tokens']:,} label tokens)"
    tl = report["token_length"]
    lines.append("tokens/sample   " + "  ".join(f"{k} {v}" for k, v in tl.items()))
    eff = report["efficiency"]
    for k in ("packing", "padding", "dynamic"):
        if k in eff:
            lines.append(f"{k:<16}{eff[k]:>9}  {meaning.get('efficiency.' + k, '')}")
    if "packed_rows" in eff:
        lines.append(f"{'packed rows':<16}{eff['packed_rows']:>9,}  {meaning['efficiency.packed_rows']} "
                     f"(seq_len {eff['seq_len']})")
    lines.append(f"speed           {report['samples_per_s']:,} samples/s  {report['tokens_per_s']:,} tokens/s "
                 f"({report['elapsed_s']} s)")
    return "\n".join(lines)
