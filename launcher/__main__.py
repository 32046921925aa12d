"""Minimal launcher (placeholder until the launcher work lands): env + recipe -> worker.

    python -m launcher train [--recipe R] [key=value ...]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from finetune.config import ConfigError, load_recipe, parse_overrides, to_dict


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="launcher")
    ap.add_argument("command", choices=["train"])
    ap.add_argument("--recipe", default=os.environ.get("RECIPE") or "tiny-cpu")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    env_over = {}
    for var, key in (("MODEL_DIR", "model.dir"), ("DATA", "data.paths"), ("OUTPUT_DIR", "output_dir")):
        if os.environ.get(var):
            env_over[key] = os.environ[var]
    cli, problems = parse_overrides(os.environ.get("OVERRIDES", "").split() + args.overrides)
    try:
        if problems:
            raise ConfigError(problems)
        recipe = load_recipe(args.recipe, {**env_over, **cli})
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    out = Path(recipe.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    plan = out / "plan.json"
    plan.write_text(json.dumps({"recipe": to_dict(recipe)}, indent=2))
    worker = Path(__file__).resolve().parent.parent / "finetune" / "worker.py"
    return subprocess.call([sys.executable, str(worker), "--config", str(plan)])


if __name__ == "__main__":
    sys.exit(main())
