"""Shared helpers for the data tests: recipes over temp files, the bundled tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

from jobspec.config import REPO_ROOT, DataConfig, Recipe
from jobspec.data import cache
from jobspec.finish import finished
from jobspec.recipe_load import load_recipe

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
    return finished(load_recipe(raw={"model": {"init": {}}}, overrides=over))


def cache_of(r: Recipe, tokenizer: Path = TOKENIZER) -> tuple[DataConfig, Path, Path]:
    """What the data functions take of a finished recipe: its data section, token cache dir and ``tokenizer``."""
    return r.data, Path(r.data.cache_dir), tokenizer


def is_fresh(r: Recipe, tokenizer: Path = TOKENIZER) -> bool:
    return cache.cache_is_fresh(r.data, Path(r.data.cache_dir), cache.settings_of(r.data, tokenizer))


QWEN3_FILES = Path(__file__).parent / "qwen3"


def qwen3_tokenizer_json() -> dict:
    """Qwen3's tokenizer.json: the bundled Qwen2.5 one with the added tokens of Qwen3's
    tokenizer_config.json (four more; see qwen3/README.md)."""
    tok = json.loads(TOKENIZER.read_text())
    added = json.loads((QWEN3_FILES / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    tok["added_tokens"] = [{"id": int(i), **{k: t[k] for k in ("content", "single_word", "lstrip", "rstrip",
                                                               "normalized", "special")}}
                           for i, t in added.items()]
    return tok


def qwen3_dir(d: Path) -> Path:
    """A Qwen3 model directory's config.json, tokenizer.json and tokenizer_config.json (the released
    chat template) under d (no weights)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}))
    (d / "tokenizer.json").write_text(json.dumps(qwen3_tokenizer_json(), ensure_ascii=False))
    (d / "tokenizer_config.json").write_bytes((QWEN3_FILES / "tokenizer_config.json").read_bytes())
    return d
