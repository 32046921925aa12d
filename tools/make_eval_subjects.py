"""Write finetune/eval/subjects.json: each subject's description line and group, as lm-eval's task YAMLs give them.

Run with the reference venv that has lm-eval (``pip install lm-eval``), never by ``make test``:

    /work/torchvenv/bin/python tools/make_eval_subjects.py

Reads the installed package's ``tasks/mmlu/default``, ``tasks/ceval`` and ``tasks/cmmlu`` YAMLs (facts about
the benchmarks' prompts: the subject's description line and, for MMLU, its group), so the prompts here
are lm-eval's without importing it.
"""
from __future__ import annotations

import json
from pathlib import Path

import lm_eval
import yaml

TASKS = Path(lm_eval.__file__).parent / "tasks"
OUT = Path(__file__).resolve().parent.parent / "finetune" / "eval" / "subjects.json"
SOURCES = {"mmlu": ("mmlu/default", "mmlu_"), "ceval-valid": ("ceval", "ceval-valid_"), "cmmlu": ("cmmlu", "cmmlu_")}


def subjects(folder: str, prefix: str) -> dict[str, dict[str, str]]:
    out = {}
    for path in sorted((TASKS / folder).glob(f"{prefix}*.yaml")):
        cfg = yaml.safe_load(path.read_text())
        entry = {"description": cfg["description"]}
        if "tag" in cfg:  # mmlu: mmlu_stem_tasks -> stem
            entry["group"] = cfg["tag"].removeprefix("mmlu_").removesuffix("_tasks")
        out[cfg["task"].removeprefix(prefix)] = entry
    return out


def main() -> None:
    data = {"lm_eval_version": lm_eval.__version__,
            **{task: subjects(folder, prefix) for task, (folder, prefix) in SOURCES.items()}}
    OUT.write_text(json.dumps(data, ensure_ascii=False, indent=1, sort_keys=True) + "\n")
    print(OUT, {k: len(v) for k, v in data.items() if isinstance(v, dict)})


if __name__ == "__main__":
    main()
