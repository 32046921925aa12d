"""lm-evaluation-harness's tasks as data: prompts, few-shot sampling and scoring, mirrored from its task YAMLs
(lm-eval 0.4.13: ``tasks/mmlu/default``, ``tasks/ceval``, ``tasks/cmmlu``, ``tasks/gsm8k/gsm8k.yaml``).

A context is ``description + k x (question + " " + answer + "\\n\\n") + question`` (lm-eval's
``fewshot_context``); a multiple-choice request scores ``" A"`` .. ``" D"`` after it. With the chat template
the description is the system turn, the rest one user turn, and the choices lose their leading space.
"""
from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.eval.loaders import LETTERS, Doc, EvalDataError, subjects_of
from jobspec.eval_config import EvalConfig, task_base

SUBJECTS = json.loads((Path(__file__).parent / "subjects.json").read_text(encoding="utf-8"))
MMLU_GROUPS = ("mmlu_stem", "mmlu_humanities", "mmlu_social_sciences", "mmlu_other")
FEWSHOT_SEED = 1234  # lm-eval's --fewshot_random_seed default
GSM8K_UNTIL = ["Question:", "</s>", "<|im_end|>"]
GSM8K_FILTERS = {"strict-match": (r"#### (\-?[0-9\.\,]+)", 0), "flexible-extract": (r"(-?[$0-9.,]{2,})|(-?[0-9]+)", -1)}
GSM8K_IGNORE = [",", "\\$", "(?s).*#### ", "\\.$"]
ARC = "Question: {question}\nAnswer:"
PERPLEXITY = ("word_perplexity", "byte_perplexity", "bits_per_byte")  # lm-eval's wikitext metrics


@dataclass(frozen=True)
class Spec:
    """One lm-eval task family: which split is scored, where shots come from and how they are drawn."""

    kind: str  # "mc" (log-likelihood of each choice) | "gen" (generate, extract, exact match) | "rolling" (perplexity)
    test_split: str
    fewshot_split: str
    sampler: str  # "first_n" | "default" (random.Random(1234).sample per document, in document order)
    shots: int  # lm-eval's num_fewshot when none is asked
    cue: str  # what closes a question
    metrics: tuple[str, ...]
    groups: bool = False  # mmlu: stem / humanities / social_sciences / other averages too
    text: str = ""  # doc_to_text of tasks whose choices are their own texts (arc, hellaswag); "": A-D letters
    exclude_doc: bool = False  # lm-eval draws k + 1 shots and drops the scored doc (hellaswag: no test split)


SPECS = {"mmlu": Spec("mc", "test", "dev", "first_n", 0, "\nAnswer:", ("acc",), groups=True),
         "ceval-valid": Spec("mc", "val", "dev", "first_n", 0, "\n答案：", ("acc", "acc_norm")),
         "cmmlu": Spec("mc", "test", "dev", "first_n", 0, "\n答案：", ("acc", "acc_norm")),
         "gsm8k": Spec("gen", "test", "train", "default", 5, "", tuple(f"exact_match,{f}" for f in GSM8K_FILTERS)),
         "arc_easy": Spec("mc", "test", "train", "default", 0, "", ("acc", "acc_norm"), text=ARC),
         "arc_challenge": Spec("mc", "test", "train", "default", 0, "", ("acc", "acc_norm"), text=ARC),
         "hellaswag": Spec("mc", "validation", "train", "default", 0, "", ("acc", "acc_norm"), text="{question}",
                           exclude_doc=True),
         "perplexity": Spec("rolling", "", "", "first_n", 0, "", PERPLEXITY)}


@dataclass
class Subtask:
    """One scored unit (a subject, or the task itself): its documents and each one's few-shot documents."""

    task: str  # mmlu
    name: str  # mmlu_anatomy (lm-eval's name)
    group: str  # mmlu_stem ("" outside mmlu)
    description: str
    docs: list[Doc]
    shots: list[list[Doc]] = field(default_factory=list)  # the few-shot documents of each doc


def _subject_description(task: str, subject: str, path: Path) -> tuple[str, str]:
    known = SUBJECTS[task].get(subject)
    if known:
        return known["description"], f"mmlu_{known['group']}" if task == "mmlu" else ""
    if task == "mmlu":  # lm-eval's wording for a subject of its own name
        return f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n", \
            "mmlu_other"
    raise EvalDataError(f"{path}: subject {subject!r} is not one of {task}'s {len(SUBJECTS[task])} (e.g. "
                        f"{next(iter(SUBJECTS[task]))}); name the files as the benchmark does")


def load_task(name: str, c: EvalConfig) -> list[Subtask]:
    """Read ``name``'s files (all subjects, or ``mmlu_<subject>``'s) and sample each document's shots."""
    task = task_base(name)
    spec = SPECS.get(task)
    if spec is None:
        raise EvalDataError(f"{name}: not scored yet; tasks: {', '.join(SPECS)}")
    root = Path(c.data_dir) / task
    readers = subjects_of(root, task)
    if name != task:
        subject = name[len(task) + 1:]
        if subject not in readers:
            raise EvalDataError(f"{root}: no files of subject {subject!r}; found {', '.join(sorted(readers))}")
        readers = {subject: readers[subject]}
    k = spec.shots if c.num_fewshot < 0 or spec.kind == "rolling" else c.num_fewshot  # perplexity: no shots
    out = []
    for subject, read in sorted(readers.items()):
        description, group = _subject_description(task, subject, root) if subject else ("", "")
        docs = read(spec.test_split)
        docs = docs[:c.limit] if c.limit else docs
        pool = read(spec.fewshot_split) if k else []
        if k and len(pool) < k + spec.exclude_doc:
            raise EvalDataError(f"{root}: {k}-shot needs {k + spec.exclude_doc} {spec.fewshot_split} examples of "
                                f"{subject or task} (lm-eval's sampler), "
                                f"found {len(pool)}; set eval.num_fewshot lower")
        rnd = random.Random(FEWSHOT_SEED)
        shots = [pool[:k] if spec.sampler == "first_n" else
                 [d for d in rnd.sample(pool, k + 1) if d != doc][:k] if spec.exclude_doc else rnd.sample(pool, k)
                 for doc in docs] if k else [[] for _ in docs]
        out.append(Subtask(task, f"{task}_{subject}" if subject else task, group, description, docs, shots))
    return out


def question(task: str, doc: Doc) -> str:
    """lm-eval's doc_to_text."""
    if SPECS[task].kind == "gen":
        return f"Question: {doc['question']}\nAnswer:"
    if SPECS[task].text:
        return SPECS[task].text.format(question=doc["question"])
    opts = "".join(f"\n{letter}. {c}" for letter, c in zip(LETTERS, doc["choices"]))
    return doc["question"].strip() + opts + SPECS[task].cue


def target(task: str, doc: Doc) -> str:
    """lm-eval's doc_to_target as text."""
    if SPECS[task].kind == "gen":
        return doc["answer"]
    return doc["choices"][doc["answer"]] if SPECS[task].text else LETTERS[doc["answer"]]


ChatRender = Callable[[list[dict[str, str]]], str]


def context(sub: Subtask, i: int, chat: ChatRender | None, multiturn: bool = False) -> str:
    """The prompt of document ``i`` as lm-eval's ``fewshot_context`` builds it; with the chat template and
    ``multiturn`` (its ``fewshot_as_multiturn``) each shot is a user turn (question) and an assistant turn (answer)."""
    system = [{"role": "system", "content": sub.description}] if sub.description else []
    if chat is not None and multiturn:
        shots = [{"role": role, "content": text} for d in sub.shots[i]
                 for role, text in (("user", question(sub.task, d)), ("assistant", target(sub.task, d)))]
        return chat(system + shots + [{"role": "user", "content": question(sub.task, sub.docs[i])}])
    turns = [question(sub.task, d) + " " + target(sub.task, d) + "\n\n" for d in sub.shots[i]]
    body = "".join(turns) + question(sub.task, sub.docs[i])
    if chat is None:
        return sub.description + body
    return chat(system + [{"role": "user", "content": body}])


def choice_texts(task: str, doc: Doc) -> list[str]:
    """lm-eval's doc_to_choice: the letters A-D, or the document's own choices (arc, hellaswag)."""
    return list(doc["choices"]) if SPECS[task].text else list(LETTERS)


def choices(task: str, doc: Doc, chat: bool) -> list[str]:
    """The continuations scored: target delimiter + each choice (no delimiter under the chat template)."""
    return [("" if chat else " ") + c for c in choice_texts(task, doc)]


def mc_scores(lls: list[float], texts: list[str], gold: int) -> dict[str, float]:
    """acc and acc_norm (log-likelihood over the choice's length in characters)."""
    norm = [ll / len(t) for ll, t in zip(lls, texts)]
    return {"acc": float(lls.index(max(lls)) == gold), "acc_norm": float(norm.index(max(norm)) == gold)}


def rolling_windows(tokens: list[int], prefix: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """lm-eval's disjoint rolling windows (context_len 1) as (context, continuation) requests: each scores up to
    ``max_length`` tokens given what precedes them (the first given ``prefix``)."""
    seq = [prefix, *tokens]
    return [(seq[:start + 1], tokens[start:start + max_length]) for start in range(0, len(tokens), max_length)]


def perplexities(lls: list[float], docs: list[Doc]) -> dict[str, float]:
    """wikitext's metrics over all documents: exp(-ll / words), exp(-ll / bytes), -ll / bytes / ln 2."""
    total = sum(lls)
    words = sum(len(re.split(r"\s+", d["text"])) for d in docs)
    nbytes = sum(len(d["text"].encode("utf-8")) for d in docs)
    return {"word_perplexity": math.exp(-total / words), "byte_perplexity": math.exp(-total / nbytes),
            "bits_per_byte": -total / nbytes / math.log(2)}


def _clean(s: str) -> str:
    for pattern in GSM8K_IGNORE:
        s = re.sub(pattern, "", s)
    return s.lower()


def extract(response: str, pattern: str, group: int) -> str:
    """lm-eval's RegexFilter followed by take_first."""
    found: list[Any] = re.findall(pattern, response)
    if not found:
        return "[invalid]"
    match = found[group]
    if isinstance(match, tuple):
        match = next((m for m in match if m), "[invalid]")
    return str(match).strip()


def gen_scores(response: str, doc: Doc) -> tuple[dict[str, float], dict[str, str]]:
    """gsm8k's exact match per filter, and what each filter extracted."""
    got = {f: extract(response, *rx) for f, rx in GSM8K_FILTERS.items()}
    return {f"exact_match,{f}": float(_clean(v) == _clean(doc["answer"])) for f, v in got.items()}, got
