"""The ``eval`` recipe section (``make eval``, env ``EVAL_TASKS`` / ``EVAL_DATA``) and its checks; pure Python.

Task names are lm-evaluation-harness's; each reads its files from ``<data_dir>/<task>/`` in the layout the
benchmark is published in (docs/evaluation.md; the loaders are finetune/eval/loaders.py).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass

from jobspec.keys import key, range_problems
from jobspec.recipe_parse import Problem

# lm-eval task names this project scores; mmlu_<subject> / ceval-valid_<subject> / cmmlu_<subject> name one subject
TASKS = ("mmlu", "ceval-valid", "cmmlu", "gsm8k", "arc_easy", "arc_challenge", "hellaswag", "perplexity")


@dataclass
class EvalConfig:
    """Benchmarks on the base model and the run's ``hf/`` export, written to ``<output_dir>/eval``."""

    # lm-eval names, e.g. [mmlu, gsm8k]; empty: each folder of data_dir
    tasks: list[str] = key(factory=list, env="EVAL_TASKS", env_help="`make eval`: lm-eval task names, comma-separated "
                           "(`mmlu,ceval-valid,gsm8k`); unset: each task folder found in `EVAL_DATA`")
    # one folder per task name, in the task's published layout
    data_dir: str = key("", path="input", example="benchmarks", env="EVAL_DATA", env_help="`make eval`: the benchmark "
                        "folder, one subfolder per task in its published layout (docs/evaluation.md)")
    # -1: the task's own (lm-eval's: 0, gsm8k 5), sampled as lm-eval does (first_n)
    num_fewshot: int = key(-1, ge=-1, rule="a count of examples, or -1 for the task's own", example="5")
    apply_chat_template: bool = False  # render each request as a chat turn (lm-eval --apply_chat_template)
    fewshot_as_multiturn: bool = True  # with the chat template: each shot a user and an assistant turn (lm-eval's
    # --fewshot_as_multiturn, on by default there with --apply_chat_template); false: all shots in one user turn
    batch_size: int = key(16, ge=1, example="16")  # requests per forward (log-likelihood) or per generation batch
    # the first N documents of each task (or subject); 0: all
    limit: int = key(0, ge=0, rule="a count of documents per task (0: all)", example="100")
    # generation tasks (gsm8k): new tokens per answer, lm-eval's default
    max_gen_toks: int = key(256, ge=1, example="16")
    after_training: bool = False  # run the tasks at the end of make train (the base once, cached)


def task_base(name: str) -> str:
    """``mmlu_anatomy`` -> ``mmlu``: the task family of a task or subject name."""
    for base in sorted(TASKS, key=len, reverse=True):
        if name == base or name.startswith(base + "_"):
            return base
    return ""


def eval_problems(c: EvalConfig) -> list[Problem]:
    """Every bad value of the ``eval`` section (files are checked by the loaders before a model loads)."""
    p: list[Problem] = []
    for t in c.tasks:
        if not task_base(t):
            close = difflib.get_close_matches(t, TASKS, n=1)
            p.append(Problem("eval.tasks", f"unknown task {t!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                             + f"; tasks: {', '.join(TASKS)} (a subject: mmlu_anatomy)", "mmlu,gsm8k", repr(t)))
    p += range_problems(c, "eval.")
    if c.after_training and not c.data_dir:
        p.append(Problem("eval.data_dir", "eval.after_training needs the benchmark folder: one subfolder per task "
                         "(EVAL_DATA)", "/data/benchmarks"))
    return p
