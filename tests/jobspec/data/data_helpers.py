"""Shared helpers for the data tests: recipes over temp files, the bundled tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

from jobspec.config import REPO_ROOT, load_recipe

TOKENIZER = REPO_ROOT / "assets" / "tokenizer" / "tokenizer.json"


def write_json(path: Path, records) -> Path:
    path.write_text(json.dumps(records, ensure_ascii=False))
    return path


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def alpaca(i: int, out: str | None = None) -> dict:
    return {"instruction": f"Question number {i}: what is {i} plus {i}?", "input": "",
            "output": out if out is not None else f"The answer is {2 * i}, because {i} + {i} = {2 * i}."}


def recipe_for(tmp_path: Path, paths, **data):
    over = {"data.paths": [str(p) for p in paths], "data.num_workers": "1", "data.seq_len": "128",
            "output_dir": str(tmp_path / "out")}
    over.update({f"data.{k}": v for k, v in data.items()})
    return load_recipe(raw={"model": {"init": {}}}, overrides=over)
