"""One loaded model on one task: each subject's metrics with lm-eval's stderr, its per-document records, and the
task's (and mmlu's groups') averages weighted by size, under lm-eval's names."""
from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def doc_loglikelihoods(m: Scorer, groups: list[list[scoring.Request]], c: EvalConfig,
                       meter: scoring.Meter) -> list[list[tuple[float, bool]]]:
    """Each document's requests scored (this rank's documents; every rank's gathered), per document."""
    def score(part: list[list[scoring.Request]]) -> list[list[tuple[float, bool]]]:
        flat = scoring.loglikelihoods(m.model, [r for g in part for r in g], c.batch_size, m.max_length, meter)
        ends = list(itertools.accumulate(len(g) for g in part))
        return [flat[end - len(g):end] for g, end in zip(part, ends)]
    return m.spread(groups, score)


def score_subtask(m: Scorer, sub: Subtask, c: EvalConfig,
                  log: Callable[[str], None]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One subject's numbers and its per-document records."""
    spec = SPECS[sub.task]
    meter = scoring.Meter(sub.name, log=log)
    if spec.kind == "rolling":
        return score_rolling(m, sub, c, meter)
    contexts = [context(sub, i, m.chat) for i in range(len(sub.docs))]
    records: list[dict[str, Any]] = []
    per_doc: list[dict[str, float]] = []
    if spec.kind == "mc":
        groups = [[scoring.encode_pair(m.tok, ctx, cont) for cont in choices(sub.task, doc, m.chat is not None)]
                  for ctx, doc in zip(contexts, sub.docs)]
        for i, (doc, mine) in enumerate(zip(sub.docs, doc_loglikelihoods(m, groups, c, meter))):
            per_doc.append(mc_scores([ll for ll, _ in mine], choice_texts(sub.task, doc), doc["answer"]))
            records.append({"doc_id": i, "subtask": sub.name, "target": doc["answer"],
                            "loglikelihoods": [ll for ll, _ in mine], "is_greedy": [g for _, g in mine], **per_doc[-1]})
    else:
        texts = m.spread(contexts, lambda part: scoring.generate_until(
            m.model, m.tok, part, [*GSM8K_UNTIL], c.max_gen_toks, m.max_length, m.stops, c.batch_size,
            m.repetition_penalty, meter))
        for i, (doc, text) in enumerate(zip(sub.docs, texts)):
            scores, got = gen_scores(text, doc)
            per_doc.append(scores)
            records.append({"doc_id": i, "subtask": sub.name, "target": doc["answer"], "response": text,
                            "filtered": got, **scores})
    k = len(sub.shots[0]) if sub.shots else 0
    return _summary(per_doc, spec.metrics, k), records


def score_rolling(m: Scorer, sub: Subtask, c: EvalConfig,
                  meter: scoring.Meter) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Perplexity: each document's log-likelihood over rolling windows, pooled as lm-eval's wikitext pools it."""
    windows = [rolling_windows(m.tok.encode(d["text"], add_special_tokens=False).ids, m.prefix_id, m.max_length)
               for d in sub.docs]
    per_doc = [sum(ll for ll, _ in lls) for lls in doc_loglikelihoods(m, windows, c, meter)]
    records = [{"doc_id": i, "subtask": sub.name, "loglikelihood": ll, "tokens": sum(len(w[1]) for w in ws)}
               for i, (ll, ws) in enumerate(zip(per_doc, windows))]
    out = {"n": len(sub.docs), "num_fewshot": 0, **perplexities(per_doc, sub.docs)}
    return {**out, **{f"{k}_stderr": None for k in SPECS[sub.task].metrics}}, records


def score_task(m: Scorer, name: str, subs: list[Subtask], c: EvalConfig,
               log: Callable[[str], None]) -> tuple[dict[str, Any], list]:
    """Every subtask of ``name`` plus its averages (mmlu: its four groups too), lm-eval's names as keys."""
    results: dict[str, Any] = {}
    records: list[dict[str, Any]] = []
    start = time.time()
    for sub in subs:
        results[sub.name], recs = score_subtask(m, sub, c, log)
        records += recs
    metrics = SPECS[subs[0].task].metrics
    if len(subs) > 1 or subs[0].name != name:
        groups: dict[str, list[dict[str, Any]]] = {}
        for sub in subs:
            if sub.group:
                groups.setdefault(sub.group, []).append(results[sub.name])
        if SPECS[subs[0].task].groups:
            results.update({g: aggregate(parts, metrics) for g, parts in sorted(groups.items())})
        results[name] = aggregate([results[s.name] for s in subs], metrics)
    log(f"[eval] {name}: " + ", ".join(f"{m} {results[name][m]:.4f}" for m in metrics)
        + f" (n={results[name]['n']}, {time.time() - start:.1f} s)")
    return results, records
