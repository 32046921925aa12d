"""Golden scores from lm-evaluation-harness for the evaluator's tests (tests/finetune/eval/).

Run with a torch venv holding lm-eval (``pip install torch transformers lm-eval``), never by ``make test``:

    HF_DATASETS_OFFLINE=1 /work/torchvenv/bin/python tools/make_eval_golden.py [CASE ...]

It builds the seeded tiny model of :data:`MODEL` (jobspec.tiny, the real Qwen2.5 tokenizer), and runs lm-eval's
``hf`` model (fp32) on the synthetic files of tests/finetune/eval/data through tasks whose prompts, sampling
and metrics are lm-eval's own YAMLs (mmlu's default template, ceval-valid, gsm8k) with only the dataset
swapped for the local files. Writes tests/finetune/eval/golden.json: per case and subtask each document's
log-likelihoods (or generated answer) and the metrics.
"""
from __future__ import annotations

import csv
import json
import shutil
import sys
import tempfile
from pathlib import Path

import lm_eval
import transformers
import yaml
from lm_eval.tasks import TaskManager

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from jobspec.tiny import ensure_tiny_model

DATA = ROOT / "tests" / "finetune" / "eval" / "data"
OUT = ROOT / "tests" / "finetune" / "eval" / "golden.json"
TASKS = Path(lm_eval.__file__).parent / "tasks"
# the embedded default's shape (recipes/tiny-cpu.yaml) with wider weights, so choices' scores are far apart
MODEL = {"overrides": {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "tie_word_embeddings": True}, "seed": 3, "std": 0.3}
SUBJECTS = {"mmlu": ["anatomy", "high_school_physics"], "ceval-valid": ["accountant", "high_school_physics"]}
# case -> (tasks, num_fewshot or None for the task's own, apply_chat_template, fewshot_as_multiturn)
CASES = {"zero-shot": (["mmlu", "ceval-valid"], 0, False, False),
         "two-shot": (["mmlu", "ceval-valid"], 2, False, False), "chat": (["mmlu"], 0, True, True),
         "chat-two-shot-multiturn": (["mmlu"], 2, True, True), "chat-two-shot-one-turn": (["mmlu"], 2, True, False),
         "gsm8k": (["gsm8k"], None, False, False), "choice-texts": (["arc_easy", "hellaswag"], 2, False, False),
         "perplexity": (["perplexity"], 0, False, False)}
# mmlu's group tree as lm-eval's YAMLs build it (mmlu over its four groups, each over its subjects; ours are all
# stem), aggregated as they aggregate: acc weighted by size, stderr pooled at each level
MMLU_GROUP = "golden_mmlu"
MMLU_GROUPS = {"mmlu_stem": "_mmlu_stem.yaml", "mmlu": "_mmlu.yaml"}
PERPLEXITY_MAX_LENGTH = 16  # the model's context in the perplexity case, so documents span several windows


def lm_eval_yaml(folder: str, name: str) -> dict:
    """An installed task YAML with its ``include`` chain merged (the included file first)."""
    path = TASKS / folder / name
    cfg = yaml.safe_load(path.read_text())
    if "include" in cfg:
        cfg = {**lm_eval_yaml(folder, cfg.pop("include")), **cfg}
    return cfg


def mmlu_json(tmp: Path, subject: str) -> dict[str, str]:
    """Our original-layout CSVs as the hub's fields (question, subject, choices, answer index)."""
    files = {}
    for split in ("dev", "test"):
        rows = list(csv.reader((DATA / "mmlu" / "data" / split / f"{subject}_{split}.csv").open()))
        out = tmp / f"mmlu_{subject}_{split}.jsonl"
        out.write_text("".join(json.dumps({"question": r[0], "subject": subject, "choices": r[1:5],
                                           "answer": "ABCD".index(r[5])}) + "\n" for r in rows))
        files[split] = str(out)
    return files


def task_yamls(tmp: Path) -> dict[str, list[str]]:
    """Write one YAML per subject (lm-eval's config, local data); task -> the golden task names."""
    names: dict[str, list[str]] = {}
    for s in SUBJECTS["mmlu"]:
        cfg = lm_eval_yaml("mmlu/default", f"mmlu_{s}.yaml")
        cfg.update(task=f"golden_mmlu_{s}", dataset_path="json", dataset_kwargs={"data_files": mmlu_json(tmp, s)})
        cfg.pop("dataset_name", None), cfg.pop("tag", None)
        names.setdefault("mmlu", []).append(cfg["task"])
        (tmp / f"{cfg['task']}.yaml").write_text(yaml.safe_dump(cfg, allow_unicode=True))
    members = {"mmlu_stem": names["mmlu"], "mmlu": ["golden_mmlu_stem"]}
    for ours, theirs in MMLU_GROUPS.items():
        group = lm_eval_yaml("mmlu/default", theirs)
        (tmp / f"golden_{ours}.yaml").write_text(yaml.safe_dump({
            "group": f"golden_{ours}", "task": members[ours], "aggregate_metric_list": group["aggregate_metric_list"],
            "metadata": group.get("metadata", {})}))
    for s in SUBJECTS["ceval-valid"]:
        cfg = lm_eval_yaml("ceval", f"ceval-valid_{s}.yaml")
        files = {sp: str(DATA / "ceval-valid" / sp / f"{s}_{sp}.csv") for sp in ("dev", "val")}
        cfg.update(task=f"golden_ceval-valid_{s}", dataset_path="csv", dataset_kwargs={"data_files": files})
        cfg.pop("dataset_name", None)
        names.setdefault("ceval-valid", []).append(cfg["task"])
        (tmp / f"{cfg['task']}.yaml").write_text(yaml.safe_dump(cfg, allow_unicode=True))
    cfg = lm_eval_yaml("arc", "arc_easy.yaml")
    cfg.update(task="golden_arc_easy", dataset_path="json", tag=[], dataset_kwargs={
        "data_files": {sp: str(DATA / "arc_easy" / f"{sp}.jsonl") for sp in ("train", "validation", "test")}})
    cfg.pop("dataset_name", None)
    names["arc_easy"] = [cfg["task"]]
    (tmp / "golden_arc_easy.yaml").write_text(yaml.safe_dump(cfg, allow_unicode=True))
    # hellaswag's YAML names its process_docs as !function utils.process_docs: the installed file is copied beside it
    shutil.copy(TASKS / "hellaswag" / "utils.py", tmp / "utils.py")
    text = (TASKS / "hellaswag" / "hellaswag.yaml").read_text()
    files = {"train": str(DATA / "hellaswag" / "hellaswag_train.jsonl"),
             "validation": str(DATA / "hellaswag" / "hellaswag_val.jsonl")}
    text = text.replace("task: hellaswag", "task: golden_hellaswag").replace("dataset_path: Rowan/hellaswag",
                                                                            "dataset_path: json")
    text = text.replace("tag:\n  - multiple_choice\n", "")
    text += "dataset_kwargs:\n  data_files: " + json.dumps(files) + "\n"
    names["hellaswag"] = ["golden_hellaswag"]
    (tmp / "golden_hellaswag.yaml").write_text(text)
    # perplexity: our documents as wikitext's "page", scored by wikitext's own process_results and metrics
    shutil.copy(TASKS / "wikitext" / "preprocess_wikitext.py", tmp / "preprocess_wikitext.py")
    pages = [(DATA / "perplexity" / "notes.txt").read_text()] + [
        json.loads(line)["text"] for line in (DATA / "perplexity" / "val.jsonl").read_text().splitlines()]
    (tmp / "pages.jsonl").write_text("".join(json.dumps({"page": p}) + "\n" for p in pages))
    text = (TASKS / "wikitext" / "wikitext.yaml").read_text()
    text = text.replace("task: wikitext", "task: golden_perplexity").replace(
        "dataset_path: EleutherAI/wikitext_document_level", "dataset_path: json").replace(
        "dataset_name: wikitext-2-raw-v1\n", "").replace("training_split: train\n", "").replace(
        "validation_split: validation\n", "").replace(
        "doc_to_target: !function preprocess_wikitext.wikitext_detokenizer", 'doc_to_target: "{{page}}"')
    names["perplexity"] = ["golden_perplexity"]
    (tmp / "golden_perplexity.yaml").write_text(text + "dataset_kwargs:\n  data_files: "
                                                + json.dumps({"test": str(tmp / "pages.jsonl")}) + "\n")
    cfg = lm_eval_yaml("gsm8k", "gsm8k.yaml")
    cfg.update(task="golden_gsm8k", dataset_path="json", tag=[],
               dataset_kwargs={"data_files": {sp: str(DATA / "gsm8k" / f"{sp}.jsonl") for sp in ("train", "test")}})
    cfg.pop("dataset_name", None)
    names["gsm8k"] = [cfg["task"]]
    (tmp / "golden_gsm8k.yaml").write_text(yaml.safe_dump(cfg, allow_unicode=True))
    return names


def first_arg(arguments: list | dict) -> str:
    """The context string of a logged sample's first request (a list or a dict as lm-eval versions log it)."""
    first = arguments[0] if isinstance(arguments, list) else next(iter(arguments.values()))
    return first[0] if isinstance(first, (list, tuple)) else next(iter(first.values()))


def our_key(key: str) -> str:
    """lm-eval's ``acc,none`` / ``acc_stderr,none`` / ``exact_match_stderr,strict-match`` as this project names
    them: ``acc`` / ``acc_stderr`` / ``exact_match,strict-match_stderr``."""
    metric, filt = key.split(",", 1)
    base = metric.removesuffix("_stderr") + ("" if filt == "none" else f",{filt}")
    return base + ("_stderr" if metric.endswith("_stderr") else "")


def run_case(model_dir: Path, tmp: Path, names: dict[str, list[str]], case: str) -> dict:
    tasks, shots, chat, multiturn = CASES[case]
    extra = f",max_length={PERPLEXITY_MAX_LENGTH}" if case == "perplexity" else ""
    asked = [t for task in tasks for t in ([MMLU_GROUP] if task == "mmlu" else names[task])]
    res = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={model_dir},dtype=float32{extra}",
                                  device="cpu", tasks=asked, num_fewshot=shots, apply_chat_template=chat,
                                  fewshot_as_multiturn=multiturn, log_samples=True, batch_size=4,
                                  task_manager=TaskManager(include_path=str(tmp)), random_seed=0,
                                  numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=1234)
    out = {}
    for task in tasks:
        for t in names[task]:
            name = t.removeprefix("golden_")
            docs = list({s["doc_id"]: s for s in sorted(res["samples"][t], key=lambda s: s["doc_id"],
                                                        reverse=True)}.values())[::-1]  # one per doc, not per filter
            entry = {"metrics": {our_key(k): v for k, v in res["results"][t].items() if isinstance(v, float)},
                     "n": len(docs), "num_fewshot": res["n-shot"][t]}
            if task == "perplexity":
                entry["loglikelihoods"] = [d["resps"][0][0] for d in docs]
            elif task == "gsm8k":
                entry["responses"] = [d["resps"][0][0] for d in docs]
            else:
                entry["loglikelihoods"] = [[r[0][0] for r in d["resps"]] for d in docs]
                entry["is_greedy"] = [[r[0][1] for r in d["resps"]] for d in docs]
            entry["contexts"] = [first_arg(d["arguments"]) for d in docs]
            out[name] = entry
    if "mmlu" in tasks:  # the groups' numbers under our names for them
        out["_groups"] = {g: {our_key(k): v for k, v in res["results"][f"golden_{g}"].items() if isinstance(v, float)}
                          for g in MMLU_GROUPS}
    return out


def main() -> None:
    only = sys.argv[1:] or list(CASES)  # case names: rerun only these, keeping the others' numbers
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        model_dir = tmp / "model"
        ensure_tiny_model(model_dir, MODEL["overrides"], MODEL["seed"], MODEL["std"])
        names = task_yamls(tmp)
        kept = json.loads(OUT.read_text())["cases"] if OUT.is_file() and only != list(CASES) else {}
        golden = {"lm_eval": lm_eval.__version__, "transformers": transformers.__version__, "model": MODEL,
                  "cases": {case: run_case(model_dir, tmp, names, case) if case in only else kept[case]
                            for case in CASES}}
    OUT.write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n")
    print(OUT)


if __name__ == "__main__":
    main()
