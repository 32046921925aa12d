"""One loaded model on one task: each subject's metrics with lm-eval's stderr, its per-document records, and the
task's (and mmlu's groups') averages weighted by size with pooled stderr, under lm-eval's names; all subjects of a
task are scored in one request pool."""
from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from finetune.dist import RankInfo
from finetune.eval import scoring
from finetune.eval.dp import Spread
from finetune.eval.tasks import (
    GSM8K_UNTIL,
    SPECS,
    ChatRender,
    Subtask,
    choice_texts,
    choices,
    context,
    gen_scores,
    mc_scores,
    perplexities,
    rolling_windows,
)
from jobspec.eval_config import EvalConfig

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class Scorer:
    """A loaded model and what scoring needs of it: tokenizer, stop tokens, context length, chat template and
    the repetition penalty of its generation_config.json (transformers applies it to greedy answers too)."""

    model: Any
    tok: Any
    stops: set[int]
    max_length: int
    chat: ChatRender | None = None
    repetition_penalty: float = 1.0
    prefix_id: int = 0  # the token before a perplexity document: the tokenizer's BOS, else its EOS (lm-eval's)
    spread: Spread = field(default_factory=lambda: Spread(RankInfo(), Path(".")))  # DP ranks' shares


def stderr(values: list[float]) -> float | None:
    """lm-eval's mean_stderr: the sample standard deviation over sqrt(n); None below two values."""
    n = len(values)
    if n < 2:
        return None
    mu = sum(values) / n
    return math.sqrt(sum((v - mu) ** 2 for v in values) / (n - 1)) / math.sqrt(n)


def aggregate(parts: list[dict[str, Any]], metrics: tuple[str, ...]) -> dict[str, Any]:
    """A group's numbers as lm-eval weights them by size: mean of the parts, pooled stderr."""
    sizes = [p["n"] for p in parts]
    out: dict[str, Any] = {"n": sum(sizes), "num_fewshot": parts[0]["num_fewshot"]}
    for m in metrics:
        out[m] = sum(p[m] * n for p, n in zip(parts, sizes)) / sum(sizes)
        errs = [p.get(f"{m}_stderr") for p in parts]
        if None not in errs and sum(sizes) > len(sizes):
            var = sum((n - 1) * e ** 2 * n for n, e in zip(sizes, errs)) / (sum(sizes) - len(sizes))  # type: ignore
            out[f"{m}_stderr"] = math.sqrt(var / sum(sizes))
        else:
            out[f"{m}_stderr"] = None
    return out


def _summary(per_doc: list[dict[str, float]], metrics: tuple[str, ...], k: int) -> dict[str, Any]:
    out: dict[str, Any] = {"n": len(per_doc), "num_fewshot": k}
    for m in metrics:
        values = [d[m] for d in per_doc]
        out[m], out[f"{m}_stderr"] = sum(values) / max(len(values), 1), stderr(values)
    return out


def pooled(parts: list[list[T]], fn: Callable[[list[T]], list[R]]) -> list[list[R]]:
    """``fn`` over every part's items at once (one request pool, one sort by length), split back per part."""
    flat = fn([x for part in parts for x in part])
    ends = list(itertools.accumulate(len(p) for p in parts))
    return [flat[end - len(p):end] for p, end in zip(parts, ends)]


def doc_loglikelihoods(m: Scorer, docs: list[list[list[scoring.Request]]], c: EvalConfig,
                       meter: scoring.Meter) -> list[list[list[tuple[float, bool]]]]:
    """Each subtask's documents' requests scored in one pool (this rank's documents; every rank's gathered)."""
    def score(part: list[list[scoring.Request]]) -> list[list[tuple[float, bool]]]:
        return pooled(part, lambda flat: scoring.loglikelihoods(m.model, flat, c.batch_size, m.max_length, meter))
    return pooled(docs, lambda flat: m.spread(flat, score))


Scored = tuple[dict[str, Any], list[dict[str, Any]]]  # a subtask's numbers and its per-document records


def _shots(sub: Subtask) -> int:
    return len(sub.shots[0]) if sub.shots else 0


def _contexts(m: Scorer, subs: list[Subtask], c: EvalConfig) -> list[list[str]]:
    return [[context(sub, i, m.chat, c.fewshot_as_multiturn) for i in range(len(sub.docs))] for sub in subs]


def score_mc(m: Scorer, subs: list[Subtask], c: EvalConfig, meter: scoring.Meter) -> list[Scored]:
    """Multiple choice: every choice's log-likelihood, acc (and acc_norm) per document."""
    chat = m.chat is not None
    docs = [[[scoring.encode_pair(m.tok, ctx, cont) for cont in choices(sub.task, doc, chat)]
             for doc, ctx in zip(sub.docs, contexts)] for sub, contexts in zip(subs, _contexts(m, subs, c))]
    out = []
    for sub, lls in zip(subs, doc_loglikelihoods(m, docs, c, meter)):
        per_doc, records = [], []
        for i, (doc, mine) in enumerate(zip(sub.docs, lls)):
            per_doc.append(mc_scores([ll for ll, _ in mine], choice_texts(sub.task, doc), doc["answer"]))
            records.append({"doc_id": i, "subtask": sub.name, "target": doc["answer"],
                            "loglikelihoods": [ll for ll, _ in mine], "is_greedy": [g for _, g in mine], **per_doc[-1]})
        out.append((_summary(per_doc, SPECS[sub.task].metrics, _shots(sub)), records))
    return out


def score_gen(m: Scorer, subs: list[Subtask], c: EvalConfig, meter: scoring.Meter) -> list[Scored]:
    """Generation: greedy answers, each filter's extraction and exact match per document."""
    contexts = _contexts(m, subs, c)
    texts = pooled(contexts, lambda flat: m.spread(flat, lambda part: scoring.generate_until(
        m.model, m.tok, part, [*GSM8K_UNTIL], c.max_gen_toks, m.max_length, m.stops, c.batch_size,
        m.repetition_penalty, meter)))
    out = []
    for sub, answers in zip(subs, texts):
        per_doc, records = [], []
        for i, (doc, text) in enumerate(zip(sub.docs, answers)):
            scores, got = gen_scores(text, doc)
            per_doc.append(scores)
            records.append({"doc_id": i, "subtask": sub.name, "target": doc["answer"], "response": text,
                            "filtered": got, **scores})
        out.append((_summary(per_doc, SPECS[sub.task].metrics, _shots(sub)), records))
    return out


def score_rolling(m: Scorer, subs: list[Subtask], c: EvalConfig, meter: scoring.Meter) -> list[Scored]:
    """Perplexity: each document's log-likelihood over rolling windows, pooled as lm-eval's wikitext pools it."""
    windows = [[rolling_windows(m.tok.encode(d["text"], add_special_tokens=False).ids, m.prefix_id, m.max_length)
                for d in sub.docs] for sub in subs]
    out = []
    for sub, wins, lls in zip(subs, windows, doc_loglikelihoods(m, windows, c, meter)):
        per_doc = [sum(ll for ll, _ in doc) for doc in lls]
        records = [{"doc_id": i, "subtask": sub.name, "loglikelihood": ll, "tokens": sum(len(w[1]) for w in ws)}
                   for i, (ll, ws) in enumerate(zip(per_doc, wins))]
        numbers = {"n": len(sub.docs), "num_fewshot": 0, **perplexities(per_doc, sub.docs)}
        out.append(({**numbers, **{f"{k}_stderr": None for k in SPECS[sub.task].metrics}}, records))
    return out


SCORERS = {"mc": score_mc, "gen": score_gen, "rolling": score_rolling}


def score_task(m: Scorer, name: str, subs: list[Subtask], c: EvalConfig,
               log: Callable[[str], None]) -> tuple[dict[str, Any], list]:
    """Every subtask of ``name`` plus its averages (mmlu: its four groups too), lm-eval's names as keys."""
    results: dict[str, Any] = {}
    records: list[dict[str, Any]] = []
    start = time.time()
    for sub, (numbers, recs) in zip(subs, SCORERS[SPECS[subs[0].task].kind](m, subs, c, scoring.Meter(name, log=log))):
        results[sub.name] = numbers
        records += recs
    metrics = SPECS[subs[0].task].metrics
    if len(subs) > 1 or subs[0].name != name:
        groups: dict[str, list[dict[str, Any]]] = {}
        for sub in subs:
            if sub.group:
                groups.setdefault(sub.group, []).append(results[sub.name])
        if SPECS[subs[0].task].groups:  # lm-eval's tree: mmlu over its groups, each over its subjects
            results.update({g: aggregate(parts, metrics) for g, parts in sorted(groups.items())})
            results[name] = aggregate([results[g] for g in sorted(groups)], metrics)
        else:
            results[name] = aggregate([results[s.name] for s in subs], metrics)
    log(f"[eval] {name}: " + ", ".join(f"{m} {results[name][m]:.4f}" for m in metrics)
        + f" (n={results[name]['n']}, {time.time() - start:.1f} s)")
    return results, records
