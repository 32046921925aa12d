"""Benchmark files in the layouts they are published in -> documents (plain dicts); no MindSpore.

Every reader checks the columns first and raises :class:`EvalDataError` naming the file and the columns
it expects, so a wrong layout is refused before any model loads. Documents keep the file's order (lm-eval's
``first_n`` few-shot sampler and ``limit`` depend on it).

| task | layout (under ``<data_dir>/<task>/``) |
|---|---|
| mmlu | the original release ``[data/]{dev,val,test}/<subject>_{dev,val,test}.csv`` (no header: question, A-D,
  answer letter) or the hub's ``<subject>/{dev,validation,test}-*.parquet`` (question, subject, choices,
  answer index) |
| ceval-valid | ``{dev,val}/<subject>_{dev,val}.csv`` with header id, question, A, B, C, D, answer |
| cmmlu | ``{dev,test}/<subject>.csv`` with header Question, A, B, C, D, Answer |
| gsm8k | ``{train,test}.jsonl`` or the hub's ``[main/]{train,test}-*.parquet`` (question, answer "... #### N") |
| arc_easy, arc_challenge | the hub's ``[ARC-Easy/ or ARC-Challenge/]{train,validation,test}-*.parquet`` or ``.jsonl``
  (question, choices {text, label}, answerKey) |
| hellaswag | the hub's ``[data/]{train,validation}-*.parquet`` or ``hellaswag_{train,val}.jsonl`` (activity_label,
  ctx_a, ctx_b, endings, label) |
| perplexity | any ``*.txt`` (a document each) and ``*.jsonl`` (a document per line's ``text``) |
"""
from __future__ import annotations

import csv
import json
import re
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

Doc = dict[str, Any]
LETTERS = ("A", "B", "C", "D")
RELEASE_DIR = "data"  # the original MMLU/C-Eval release keeps its CSV folders under data/ (not a run path)


class EvalDataError(ValueError):
    """A benchmark file or folder that is missing or of another layout; the message names it and the fix."""


def _rows_csv(path: Path) -> list[list[str]]:
    with path.open(newline="", encoding="utf-8") as f:
        return [r for r in csv.reader(f) if r]


def _rows_parquet(paths: list[Path]) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return [row for p in paths for row in pq.read_table(p).to_pylist()]


def _need(path: Path, have: list[str], want: tuple[str, ...]) -> None:
    missing = [c for c in want if c not in have]
    if missing:
        raise EvalDataError(f"{path}: no column(s) {', '.join(missing)}; expected columns {', '.join(want)} "
                            f"(found {', '.join(map(str, have)) or 'none'})")


def _filled(files: Path | list[Path], docs: list[Doc]) -> list[Doc]:
    """``docs``, refused when there are none: an empty split would score 0 (or divide by nothing)."""
    names = ", ".join(map(str, files if isinstance(files, list) else [files]))
    if not docs:
        raise EvalDataError(f"{names}: no documents; each subject's file needs at least one row (delete the file to "
                            "leave the subject out)")
    return docs


def _mc(question: str, choices: list[Any], answer: int, subject: str) -> Doc:
    return {"question": question, "choices": [str(c) for c in choices], "answer": answer, "subject": subject}


def _letter(path: Path, i: int, value: str) -> int:
    if value.strip() not in LETTERS:
        raise EvalDataError(f"{path}: row {i + 1}: answer {value!r} is not one of A, B, C, D")
    return LETTERS.index(value.strip())


def mmlu_csv(path: Path, subject: str) -> list[Doc]:
    """The original MMLU release: no header; question, A, B, C, D, answer letter."""
    rows = _rows_csv(path)
    docs = []
    for i, r in enumerate(rows):
        if len(r) != 6:
            raise EvalDataError(f"{path}: row {i + 1} has {len(r)} fields; expected 6 without a header: "
                                "question, A, B, C, D, answer (A-D)")
        docs.append(_mc(r[0], r[1:5], _letter(path, i, r[5]), subject))
    return _filled(path, docs)


def mmlu_parquet(paths: list[Path], subject: str) -> list[Doc]:
    """The hub's cais/mmlu parquet: question, subject, choices, answer (index)."""
    rows = _rows_parquet(paths)
    for p in paths:
        import pyarrow.parquet as pq

        _need(p, pq.read_schema(p).names, ("question", "choices", "answer"))
    return _filled(paths, [_mc(r["question"], list(r["choices"]), int(r["answer"]), subject) for r in rows])


def labelled_csv(path: Path, subject: str, names: tuple[str, ...]) -> list[Doc]:
    """A CSV with a header holding the question, A-D and answer letter columns ``names`` (C-Eval, CMMLU)."""
    header, *rows = _rows_csv(path) or [[]]
    _need(path, header, names)
    q, *opts, ans = (header.index(n) for n in names)
    return _filled(path, [_mc(r[q], [r[o] for o in opts], _letter(path, i, r[ans]), subject)
                          for i, r in enumerate(rows)])


def records(paths: list[Path], fields: tuple[str, ...]) -> list[dict[str, Any]]:
    """JSON lines or parquet records holding ``fields`` (GSM8K, ARC, HellaSwag, perplexity's JSONL)."""
    rows: list[dict[str, Any]] = []
    for p in paths:
        if p.suffix == ".parquet":
            rows += _rows_parquet([p])
        else:
            try:
                rows += [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
            except json.JSONDecodeError as e:
                raise EvalDataError(f"{p}: not JSON lines ({e}); expected one object a line with "
                                    f"{', '.join(fields)}") from None
        if rows:
            _need(p, list(rows[-1]), fields)
    return rows


def arc_doc(r: dict[str, Any]) -> Doc:
    labels = list(r["choices"]["label"])
    return {"question": r["question"], "choices": list(r["choices"]["text"]), "answer": labels.index(r["answerKey"])}


def _hellaswag_clean(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


def hellaswag_doc(r: dict[str, Any]) -> Doc:
    """lm-eval's hellaswag ``process_docs``."""
    ctx = r["ctx_a"] + " " + r["ctx_b"].capitalize()
    return {"question": _hellaswag_clean(r["activity_label"] + ": " + ctx),
            "choices": [_hellaswag_clean(e) for e in r["endings"]], "answer": int(r["label"])}


def _split_reader(base: Path, names: Mapping[str, tuple[str, ...]], fields: tuple[str, ...],
                  make: Callable[[dict[str, Any]], Doc]) -> Callable[[str], list[Doc]]:
    """A reader of split -> the first of its file patterns that matches under ``base``."""
    def read(split: str) -> list[Doc]:
        for pattern in names[split]:
            files = sorted(base.glob(pattern))
            if files:
                return _filled(files, [make(r) for r in records(files, fields)])
        raise EvalDataError(f"{base}: no {' or '.join(names[split])}; expected records with {', '.join(fields)}")
    return read


def _patterns(*forms: str) -> dict[str, tuple[str, ...]]:
    return {s: tuple(f.format(s=s) for f in forms) for s in ("train", "validation", "test")}


def _qa(r: dict[str, Any]) -> Doc:
    return {"question": r["question"], "answer": r["answer"]}


def perplexity_docs(root: Path) -> list[Doc]:
    """Every ``*.txt`` (one document) and ``*.jsonl`` line (its ``text``) under ``root``, sorted by path."""
    docs: list[Doc] = []
    for p in sorted(root.rglob("*")):
        if p.suffix == ".txt":
            docs.append({"text": p.read_text(encoding="utf-8")})
        elif p.suffix == ".jsonl":
            docs += [{"text": r["text"]} for r in records([p], ("text",))]
    if not docs:
        raise EvalDataError(f"{root}: no *.txt or *.jsonl (one document per line, field text) files")
    return docs


def _find(root: Path, task: str, what: str) -> None:
    if not root.is_dir():
        raise EvalDataError(f"{root}: no such folder; eval.data_dir (EVAL_DATA) needs a folder {task}/ with {what}")


def subjects_of(root: Path, task: str) -> dict[str, Callable[[str], list[Doc]]]:
    """Subject -> reader of one split (``test``/``val``/``dev``/``train`` names as the layout spells them).

    Single-split tasks (gsm8k) have the one subject ``""``.
    """
    if task == "mmlu":
        _find(root, task, "data/{dev,val,test}/<subject>_test.csv or <subject>/test-*.parquet")
        base = root / RELEASE_DIR if (root / RELEASE_DIR).is_dir() else root
        csvs = {p.name[:-len("_test.csv")]: p for p in sorted(base.glob("test/*_test.csv"))}
        if csvs:
            return {s: partial(_mmlu_csv_split, base, s) for s in csvs}
        pq = {p.parent.name: p for p in sorted(root.glob("*/test-*.parquet")) if p.parent.name != "all"}
        if pq:
            return {s: partial(_mmlu_parquet_split, root, s) for s in pq}
        raise EvalDataError(f"{root}: no MMLU files; expected data/test/<subject>_test.csv (the original release: "
                            "question, A, B, C, D, answer; no header) or <subject>/test-*.parquet (the hub's: "
                            "question, subject, choices, answer)")
    if task in ("ceval-valid", "cmmlu"):
        ceval = task == "ceval-valid"
        _find(root, task, "val/<subject>_val.csv" if ceval else "test/<subject>.csv")
        names = ("question", "A", "B", "C", "D", "answer") if ceval else ("Question", "A", "B", "C", "D", "Answer")
        test = "val" if ceval else "test"
        files = sorted((root / test).glob("*_val.csv" if ceval else "*.csv"))
        if not files:
            raise EvalDataError(f"{root / test}: no {'<subject>_val.csv' if ceval else '<subject>.csv'} files; "
                                f"expected CSVs with the header {', '.join(names)}")
        name = (lambda p: p.name[:-len("_val.csv")]) if ceval else (lambda p: p.stem)

        def reader(s: str) -> Callable[[str], list[Doc]]:
            return lambda split: labelled_csv(_one(root / split / (f"{s}_{split}.csv" if ceval else f"{s}.csv")),
                                              s, names)
        return {name(p): reader(name(p)) for p in files}
    if task == "gsm8k":
        _find(root, task, "test.jsonl and train.jsonl (or [main/]test-*.parquet)")
        base = root / "main" if (root / "main").is_dir() else root
        return {"": _split_reader(base, _patterns("{s}.jsonl", "{s}-*.parquet"), ("question", "answer"), _qa)}
    if task in ("arc_easy", "arc_challenge"):
        _find(root, task, "test-*.parquet (the hub's ai2_arc) or test.jsonl")
        sub = root / ("ARC-Easy" if task == "arc_easy" else "ARC-Challenge")
        base = sub if sub.is_dir() else root
        return {"": _split_reader(base, _patterns("{s}-*.parquet", "{s}.jsonl"), ("question", "choices", "answerKey"),
                                  arc_doc)}
    if task == "hellaswag":
        _find(root, task, "validation-*.parquet (the hub's Rowan/hellaswag) or hellaswag_val.jsonl")
        base = root / RELEASE_DIR if (root / RELEASE_DIR).is_dir() else root
        patterns = {"validation": ("validation-*.parquet", "hellaswag_val.jsonl"),
                    "train": ("train-*.parquet", "hellaswag_train.jsonl")}
        return {"": _split_reader(base, patterns, ("activity_label", "ctx_a", "ctx_b", "endings", "label"),
                                  hellaswag_doc)}
    if task == "perplexity":
        _find(root, task, "*.txt or *.jsonl files")
        return {"": lambda split: perplexity_docs(root)}
    raise EvalDataError(f"{task}: no loader for this task")


def _mmlu_csv_split(base: Path, subject: str, split: str) -> list[Doc]:
    return mmlu_csv(_one(base / split / f"{subject}_{split}.csv"), subject)


def _mmlu_parquet_split(root: Path, subject: str, split: str) -> list[Doc]:
    hub = {"test": "test", "val": "validation", "dev": "dev"}
    return mmlu_parquet(_many(root / subject, f"{hub[split]}-*.parquet"), subject)


def _one(path: Path) -> Path:
    if not path.is_file():
        raise EvalDataError(f"{path}: not found; each subject needs its file in every split the task reads")
    return path


def _many(folder: Path, pattern: str) -> list[Path]:
    files = sorted(folder.glob(pattern))
    if not files:
        raise EvalDataError(f"{folder}: no {pattern}; each subject needs its file in every split the task reads")
    return files
