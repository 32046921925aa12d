"""Evaluate model directories side by side: ``python -m finetune.eval --model base=DIR --model hf=DIR
--tasks mmlu,gsm8k --data-dir BENCH --out OUTPUT_DIR/eval`` (the launcher's ``eval`` command builds this)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # started as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from finetune.eval.dp import tp_problem
from finetune.eval.loaders import EvalDataError
from finetune.eval.tasks import SPECS, Subtask, load_task
from jobspec.eval_config import EvalConfig, eval_problems


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = EvalConfig()
    ap = argparse.ArgumentParser(prog="ascend-finetune eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", required=True, metavar="LABEL=DIR",
                    help="a Hugging Face model directory and its name in the results (repeatable)")
    ap.add_argument("--tasks", default="", help="lm-eval task names, comma-separated; empty: each folder found")
    ap.add_argument("--data-dir", required=True, help="one folder per task, in its published layout")
    ap.add_argument("--out", required=True, help="results folder (OUTPUT_DIR/eval)")
    ap.add_argument("--num-fewshot", type=int, default=d.num_fewshot)
    ap.add_argument("--apply-chat-template", action="store_true")
    ap.add_argument("--fewshot-as-multiturn", action=argparse.BooleanOptionalAction, default=d.fewshot_as_multiturn,
                    help="with the chat template: each shot its own user and assistant turn (lm-eval's default)")
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--limit", type=int, default=d.limit)
    ap.add_argument("--max-gen-toks", type=int, default=d.max_gen_toks)
    ap.add_argument("--device", default="auto", choices=["auto", "npu", "cpu"])
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per model (parallel.tp); DP the rest")
    ap.add_argument("--reuse", action="append", default=[], metavar="LABEL",
                    help="keep <out>/LABEL.json's results when its model directory and settings are the same")
    return ap.parse_args(argv)


def task_names(c: EvalConfig) -> list[str]:
    """The asked tasks, or each folder of data_dir that names a task scored here."""
    if c.tasks:
        return c.tasks
    found = [t for t in SPECS if (Path(c.data_dir) / t).is_dir()]
    if not found:
        raise EvalDataError(f"{c.data_dir}: no task folder ({', '.join(SPECS)}); set eval.tasks (EVAL_TASKS) or "
                            "lay the benchmark files out as docs/evaluation.md shows")
    return found


def prepare(c: EvalConfig, models: dict[str, str]) -> dict[str, list[Subtask]]:
    """Every task's documents and every model's files, checked before a model loads."""
    from finetune.generate import check_weights_before_build

    tasks = {name: load_task(name, c) for name in task_names(c)}
    for d in models.values():
        check_weights_before_build(d)
        if not (Path(d) / "tokenizer.json").is_file():
            raise EvalDataError(f"{Path(d) / 'tokenizer.json'}: not found; the model directory needs its tokenizer")
    return tasks


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    c = EvalConfig(tasks=[t.strip() for t in args.tasks.split(",") if t.strip()], data_dir=args.data_dir,
                   num_fewshot=args.num_fewshot, apply_chat_template=args.apply_chat_template,
                   fewshot_as_multiturn=args.fewshot_as_multiturn,
                   batch_size=args.batch_size, limit=args.limit, max_gen_toks=args.max_gen_toks)
    models = dict(m.split("=", 1) if "=" in m else (Path(m).name, m) for m in args.model)
    problems = [p.text() for p in eval_problems(c)] + [p for p in [tp_problem(args.tp)] if p]
    if problems:
        print("[eval] " + "\n[eval] ".join(problems), file=sys.stderr)
        return 2
    from finetune.io.hf_io import HFModelError

    try:
        tasks = prepare(c, models)
    except (EvalDataError, HFModelError, FileNotFoundError) as e:
        print(f"[eval] {e}", file=sys.stderr)
        return 2
    from finetune.eval.report import evaluate_all

    evaluate_all(models, tasks, c, Path(args.out), args.device, set(args.reuse), args.tp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
