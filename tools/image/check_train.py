"""Check a finished training run: the Hugging Face export exists and the loss fell.

    python tools/image/check_train.py OUTPUT_DIR [LOG ...]

The loss values come from JSON-lines metric files under OUTPUT_DIR (records with a "loss" field)
or, when there are none, from `loss <x>` / `loss=<x>` / `loss: <x>` in the given logs, in order.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

LOSS_RE = re.compile(r"\bloss[\"']?\s*[=:]?\s*([0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?)")


def losses(out: Path, logs: list[Path]) -> list[float]:
    """Loss values in training order."""
    vals: list[float] = []
    for f in sorted(out.rglob("*.jsonl")):
        for line in f.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("loss"), (int, float)):
                vals.append(float(rec["loss"]))
    if not vals:
        for log in logs:
            vals += [float(m) for m in LOSS_RE.findall(log.read_text(errors="replace"))]
    return vals


def check(out: Path, logs: list[Path]) -> list[str]:
    """Problems found (empty: the run is good)."""
    problems = []
    hf = out / "hf"
    if not (hf / "config.json").is_file():
        problems.append(f"{hf}/config.json missing: no Hugging Face export")
    if not list(hf.glob("*.safetensors")):
        problems.append(f"{hf}: no *.safetensors weights")
    vals = losses(out, logs)
    if len(vals) < 2:
        problems.append(f"found {len(vals)} loss value(s) in {out} metrics or the logs; need 2 or more")
    elif not vals[-1] < vals[0]:
        problems.append(f"loss did not fall: first {vals[0]:.4f}, last {vals[-1]:.4f}")
    if not problems:
        print(f"check_train: export ok, loss {vals[0]:.4f} -> {vals[-1]:.4f} over {len(vals)} records")
    return problems


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    problems = check(Path(argv[0]), [Path(a) for a in argv[1:]])
    for p in problems:
        print(f"check_train: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
