"""Worker entry point: what msrun starts in every rank.

    python finetune/worker.py --config <plan.json | recipe.json>

Reads only its config (the resolved recipe, under "recipe" in plan.json) and the rank environment.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # started as a script by msrun
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from finetune.affinity import apply_binding  # noqa: E402
from finetune.config import ConfigError, load_recipe  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    apply_binding()  # the launcher's per-rank CPU/NUMA plan (may re-exec under numactl)
    ap = argparse.ArgumentParser(prog="finetune.worker")
    ap.add_argument("--config", required=True, help="plan.json or a resolved recipe JSON")
    args = ap.parse_args(argv)
    raw = json.loads(Path(args.config).read_text())
    try:
        recipe = load_recipe(raw=raw.get("recipe", raw))
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    from finetune.train import run  # imports mindspore

    return run(recipe)


if __name__ == "__main__":
    sys.exit(main())
