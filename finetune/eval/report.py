"""Run every model on every task and write the results: ``<out>/<label>.json`` per model, ``samples_<task>.jsonl``
(every model's per-document records), ``summary.json`` and the printed before/after table."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from finetune.dist import RankInfo
from finetune.eval.loaders import EvalDataError
from finetune.eval.runner import Scorer, score_task
from finetune.eval.tasks import MMLU_GROUPS, SPECS, ChatRender, Subtask
from jobspec.checkpoint_index import model_hash
from jobspec.data.chat_template import model_template, render_hf
from jobspec.eval_config import EvalConfig, task_base
from jobspec.family import family_of
from jobspec.rundir import EVAL_FILES, RunDir


def chat_renderer(model_dir: str, tokenizer_config: dict[str, Any]) -> ChatRender:
    """The model's own chat template as transformers renders it (``jobspec.data.chat_template``), generation prompt
    on."""
    template = model_template(model_dir)
    if template is None:
        raise EvalDataError(f"{model_dir} has no chat template (chat_template.jinja or tokenizer_config.json's "
                            "chat_template): set eval.apply_chat_template=false to score it without one")
    special = {k: v for k in ("bos_token", "eos_token") if isinstance(v := tokenizer_config.get(k), str)}
    return lambda messages: render_hf(template, messages, add_generation_prompt=True, special_tokens=special)


def load_scorer(model_dir: str, device: str, chat: bool, rank: RankInfo | None = None) -> Scorer:
    """The model of ``model_dir`` on ``device`` (``rank``'s TP slices) with its tokenizer, stops, context length and
    generation penalty."""
    from finetune.generate import Sampling, load_model, stop_ids
    from finetune.io.hf_io import load_hf_config

    log = rank.log if rank else print
    model, tok, _ = load_model(model_dir, device, rank)
    cfg = json.loads((Path(model_dir) / "tokenizer_config.json").read_text(encoding="utf-8"))
    hf_config = load_hf_config(model_dir)
    pad = family_of(hf_config).pad_token
    prefix = tok.token_to_id(cfg.get("bos_token") or cfg.get("eos_token") or pad)
    if prefix is None:
        log(f"[eval] {model_dir}: the tokenizer has no bos_token, eos_token or {pad}: perplexity's first "
            "window is scored after token 0")
    length, source = context_length(hf_config, cfg)
    if source == "default":
        log(f"[eval] {model_dir}: no max_position_embeddings in config.json nor model_max_length in "
            f"tokenizer_config.json: requests are cut to lm-eval's default {length} tokens")
    return Scorer(model, tok, stop_ids(tok, model_dir), length, chat_renderer(model_dir, cfg) if chat else None,
                  Sampling.of_model(model_dir).repetition_penalty, prefix if prefix is not None else 0)


def context_length(config: dict[str, Any], tokenizer_config: dict[str, Any]) -> tuple[int, str]:
    """(max_length, where it came from) as lm-eval's ``resolve_max_length`` finds it: the config's n_positions,
    max_position_embeddings or n_ctx, the tokenizer's model_max_length unless unset (1e30), else 2048."""
    for key in ("n_positions", "max_position_embeddings", "n_ctx"):
        if isinstance(config.get(key), int):
            return config[key], f"config.json {key}"
    tok_max = tokenizer_config.get("model_max_length")
    if isinstance(tok_max, int | float) and tok_max < 1e29:
        return int(tok_max), "tokenizer_config.json model_max_length"
    return LM_EVAL_MAX_LENGTH, "default"


LM_EVAL_MAX_LENGTH = 2048  # lm-eval's DEFAULT_MAX_LENGTH, for a model that states none


def headline(name: str) -> list[tuple[str, str]]:
    """(row name, metric) of the table for task ``name``: its metrics, and for mmlu its groups' accuracy."""
    metrics = SPECS[task_base(name)].metrics
    return [(name, m) for m in metrics] + ([(g, "acc") for g in MMLU_GROUPS] if name == "mmlu" else [])


def table(by_model: dict[str, dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """One row per task (and mmlu group) and metric: each model's value, and the last minus the first."""
    labels = list(by_model)
    rows = []
    for name in names:
        for task, metric in headline(name):
            if task not in by_model[labels[0]]:  # an mmlu group without subjects here
                continue
            row: dict[str, Any] = {"task": task, "metric": metric, "n": by_model[labels[0]][task]["n"]}
            row.update({label: by_model[label][task][metric] for label in labels})
            if len(labels) > 1:
                row["delta"] = row[labels[-1]] - row[labels[0]]
            rows.append(row)
    return rows


def _cell(v: float, sign: bool = False) -> str:
    """A table cell: 4 decimals, or 4 significant digits for large numbers (perplexities)."""
    return format(v, ">" + ("+" if sign else "") + ("12.4g" if abs(v) >= 1e4 else "12.4f"))


def print_table(rows: list[dict[str, Any]], labels: list[str]) -> None:
    cols = labels + (["delta"] if len(labels) > 1 else [])
    print(f"{'task':<24} {'metric':<30} {'n':>6} " + " ".join(f"{c:>12}" for c in cols), flush=True)
    for r in rows:
        print(f"{r['task']:<24} {r['metric']:<30} {r['n']:>6} " + " ".join(_cell(r[c], c == "delta") for c in cols))


def reusable(out: Path, label: str, identity: str, settings: dict[str, Any], tasks: list[str]) -> bool:
    """Whether ``<out>/<label>.json`` holds the results of these weights (``identity``: jobspec.checkpoint_index'
    model_hash) for these settings (the device included) and tasks."""
    path = out / f"{label}.json"
    if not path.is_file():
        return False
    old = json.loads(path.read_text())
    same = old.get("identity") == identity and old["settings"] == settings
    return same and all(t in old["results"] for t in tasks)


def earlier_samples(out: Path, task: str, label: str) -> list[dict[str, Any]]:
    path = out / f"samples_{task}.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.is_file() else []
    return [r for r in rows if r["model"] == label]


def write_scalars(logdir: Path, rows: list[dict[str, Any]], labels: list[str]) -> None:
    """The table as TensorBoard scalars, one run per model (``eval/<task>/<metric>``), so runs compare side by side."""
    from tensorboardX import SummaryWriter

    for label in labels:
        with SummaryWriter(str(logdir / label)) as tb:
            for r in rows:
                tb.add_scalar(f"eval/{r['task']}/{r['metric']}", r[label], 0)


def evaluate_all(models: dict[str, str], tasks: dict[str, list[Subtask]], c: EvalConfig, out: Path,
                 device: str, reuse: set[str] = frozenset(), tp: int = 1) -> dict[str, Any]:  # type: ignore[assignment]
    """Score each model (loaded one at a time; under msrun each DP rank a share of the requests, each model split
    over ``tp`` ranks) and write the results from rank 0; returns summary.json's content. Models in ``reuse`` keep
    their earlier results where :func:`reusable` allows."""
    from finetune.eval.dp import Spread, join

    rank = join(device, tp)
    out.mkdir(parents=True, exist_ok=True)
    by_model: dict[str, dict[str, Any]] = {}
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in tasks}
    settings = {**{k: v for k, v in dataclasses.asdict(c).items() if k != "after_training"},
                "device": rank.device_target}  # fp32 on CPU, the compute dtype on an NPU: other scores
    identity = {label: model_hash(d, RunDir(out.parent).hashes) for label, d in models.items()}
    for label, model_dir in models.items():
        if label in reuse and reusable(out, label, identity[label], settings, list(tasks)):
            rank.log(f"[eval] {label}: the results of {out / (label + '.json')} (same model and settings)")
            by_model[label] = json.loads((out / f"{label}.json").read_text())["results"]
            for name in tasks:
                samples[name] += earlier_samples(out, name, label)
            continue
        rank.log(f"[eval] loading {label}: {model_dir}" + (f" on {rank.world_size} ranks (TP {rank.tp} x DP {rank.dp})"
                                                             if rank.world_size > 1 else ""))
        scorer = dataclasses.replace(load_scorer(model_dir, device, c.apply_chat_template, rank),
                                     spread=Spread(rank, out))
        by_model[label] = {}
        for name, subs in tasks.items():
            res, recs = score_task(scorer, name, subs, c, rank.log)
            by_model[label].update(res)
            samples[name] += [{"model": label, **r} for r in recs]
    summary = {"models": models, "identity": identity, "settings": settings, "table": table(by_model, list(tasks))}
    if rank.is_main:
        write_all(out, by_model, samples, summary)
    return summary


def write_all(out: Path, by_model: dict[str, dict[str, Any]], samples: dict[str, list[dict[str, Any]]],
              summary: dict[str, Any]) -> None:
    """``<label>.json`` per model, ``samples_<task>.jsonl``, the printed table, its scalars and summary.json."""
    for label, results in by_model.items():
        doc = {"model": label, "model_dir": str(summary["models"][label]), "identity": summary["identity"][label],
               "settings": summary["settings"], "results": results}
        (out / f"{label}.json").write_text(json.dumps(doc, indent=1) + "\n")
    for name, recs in samples.items():
        with (out / f"samples_{name}.jsonl").open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in recs)
    print_table(summary["table"], list(by_model))
    write_scalars(out / EVAL_FILES["tensorboard"], summary["table"], list(by_model))
    (out / EVAL_FILES["summary"]).write_text(json.dumps(summary, indent=1) + "\n")
