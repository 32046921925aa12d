"""The benchmark layouts: the hub's parquet MMLU reads as the original CSVs do, CMMLU's header layout reads,
and a file of another layout is refused naming the file and the expected columns (no model involved)."""
from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from finetune.eval.loaders import EvalDataError
from finetune.eval.tasks import context, load_task
from jobspec.eval_config import EvalConfig, eval_problems

DATA = Path(__file__).parent / "data"


def cfg(root: Path, task: str, **kw) -> EvalConfig:
    return EvalConfig(tasks=[task], data_dir=str(root), **kw)


def test_mmlu_parquet_layout_gives_the_csv_layouts_documents(tmp_path):
    for split in ("dev", "test"):
        for f in (DATA / "mmlu" / "data" / split).glob("*.csv"):
            subject = f.name.rsplit("_", 1)[0]
            rows = list(csv.reader(f.open()))
            table = pa.table({"question": [r[0] for r in rows], "subject": [subject] * len(rows),
                              "choices": [r[1:5] for r in rows], "answer": ["ABCD".index(r[5]) for r in rows]})
            (tmp_path / "mmlu" / subject).mkdir(parents=True, exist_ok=True)
            pq.write_table(table, tmp_path / "mmlu" / subject / f"{split}-00000-of-00001.parquet")
    a, b = load_task("mmlu", cfg(DATA, "mmlu", num_fewshot=2)), load_task("mmlu", cfg(tmp_path, "mmlu", num_fewshot=2))
    assert [s.docs for s in a] == [s.docs for s in b] and len(a) == 2
    assert [context(s, 0, None) for s in a] == [context(s, 0, None) for s in b]
    assert [s.group for s in a] == ["mmlu_stem", "mmlu_stem"]


def test_one_subject_and_limit():
    (sub,) = load_task("mmlu_anatomy", cfg(DATA, "mmlu_anatomy", limit=2))
    assert sub.name == "mmlu_anatomy" and len(sub.docs) == 2
    assert context(sub, 0, None).startswith("The following are multiple choice questions (with answers) about "
                                            "anatomy.\n\nWhich cells carry oxygen in the blood?\nA. Red blood cells")


def test_cmmlu_header_layout(tmp_path):
    for split in ("dev", "test"):
        (tmp_path / "cmmlu" / split).mkdir(parents=True)
        theirs = "dev" if split == "dev" else "val"
        src = DATA / "ceval-valid" / theirs / f"accountant_{theirs}.csv"
        rows = list(csv.DictReader(src.open()))
        with (tmp_path / "cmmlu" / split / "agronomy.csv").open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["", "Question", "A", "B", "C", "D", "Answer"])
            w.writerows([[i, r["question"], r["A"], r["B"], r["C"], r["D"], r["answer"]] for i, r in enumerate(rows)])
    (sub,) = load_task("cmmlu", cfg(tmp_path, "cmmlu"))
    assert sub.name == "cmmlu_agronomy" and len(sub.docs) == 3
    assert context(sub, 0, None).startswith("以下是关于农学的单项选择题，请直接给出正确答案的选项。\n\n"
                                            "利润等于收入减去什么？\nA. 资产")


def test_wrong_layout_is_refused_naming_file_and_columns(tmp_path):
    shutil.copytree(DATA / "ceval-valid", tmp_path / "ceval-valid")
    bad = tmp_path / "ceval-valid" / "val" / "accountant_val.csv"
    bad.write_text("id,question,A,B,C,answer\n1,q,a,b,c,A\n")
    with pytest.raises(EvalDataError, match=r"accountant_val.csv: no column\(s\) D; expected columns question, A,"):
        load_task("ceval-valid", cfg(tmp_path, "ceval-valid"))
    (tmp_path / "mmlu" / "data" / "test").mkdir(parents=True)
    (tmp_path / "mmlu" / "data" / "test" / "anatomy_test.csv").write_text("q,a,b,c,d\n")
    with pytest.raises(EvalDataError, match=r"anatomy_test.csv: row 1 has 5 fields; expected 6 without a header"):
        load_task("mmlu", cfg(tmp_path, "mmlu"))
    with pytest.raises(EvalDataError, match=r"gsm8k: no such folder"):
        load_task("gsm8k", cfg(tmp_path, "gsm8k"))


@pytest.mark.parametrize("task,path", [("mmlu", "mmlu/data/test/anatomy_test.csv"),
                                       ("ceval-valid", "ceval-valid/val/accountant_val.csv"),
                                       ("gsm8k", "gsm8k/test.jsonl")])
def test_an_empty_file_is_refused_naming_it(tmp_path, task, path):
    shutil.copytree(DATA / task, tmp_path / task)
    lines = (tmp_path / path).read_text(encoding="utf-8").splitlines()
    (tmp_path / path).write_text("".join(line + "\n" for line in lines[:1 if task == "ceval-valid" else 0]))
    with pytest.raises(EvalDataError, match=f"{tmp_path / path}: no documents"):  # not a score of 0
        load_task(task, cfg(tmp_path, task, num_fewshot=0))


def test_config_problems_name_the_key():
    problems = eval_problems(EvalConfig(tasks=["mmlu", "gsm8"], batch_size=0))
    assert [p.key for p in problems] == ["eval.tasks", "eval.batch_size"]
    assert "did you mean 'gsm8k'" in problems[0].text()


def test_shots_need_enough_examples_and_perplexity_takes_none():
    (hs,) = load_task("hellaswag", cfg(DATA, "hellaswag"))  # zero-shot: the train split is not read
    assert hs.shots == [[], []]
    with pytest.raises(EvalDataError, match=r"3-shot needs 4 train examples of hellaswag \(lm-eval's sampler\)"):
        load_task("hellaswag", cfg(DATA, "hellaswag", num_fewshot=3))
    (ppl,) = load_task("perplexity", cfg(DATA, "perplexity", num_fewshot=5))
    assert ppl.shots == [[], [], []] and ppl.docs[0]["text"].startswith("The quick brown fox")


def test_the_chat_template_is_the_model_s_wherever_it_keeps_it(tmp_path):
    """eval.apply_chat_template reads the template as training does (chat_template.jinja or
    tokenizer_config.json); a model with none is refused naming the setting, not a KeyError."""
    from finetune.eval.loaders import EvalDataError
    from finetune.eval.report import chat_renderer

    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(EvalDataError, match="eval.apply_chat_template=false"):
        chat_renderer(str(tmp_path), {})
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}<{{ m.content }}>{% endfor %}"
                                                  "{% if add_generation_prompt %}{{ eos_token }}{% endif %}")
    render = chat_renderer(str(tmp_path), {"eos_token": "<e>"})
    assert render([{"role": "user", "content": "q"}]) == "<q><e>"


def test_earlier_results_are_reused_only_for_the_same_weights_settings_and_device(tmp_path):
    """A base model's results stand while its weights (model_hash), the settings and the device are the same;
    new weights at the same path, or an NPU run after a CPU one (fp32 against bf16), score again."""
    import json

    from finetune.eval.report import reusable

    settings = {"num_fewshot": 0, "device": "CPU"}
    (tmp_path / "base.json").write_text(json.dumps({"identity": "abc", "settings": settings,
                                                    "results": {"mmlu": {}}}))
    assert reusable(tmp_path, "base", "abc", settings, ["mmlu"])
    assert not reusable(tmp_path, "base", "new", settings, ["mmlu"])
    assert not reusable(tmp_path, "base", "abc", {**settings, "device": "Ascend"}, ["mmlu"])
    assert not reusable(tmp_path, "base", "abc", settings, ["mmlu", "gsm8k"])


def test_the_context_length_is_found_where_lm_eval_finds_it():
    from finetune.eval.report import LM_EVAL_MAX_LENGTH, context_length

    assert context_length({"max_position_embeddings": 32768}, {"model_max_length": 512}) == \
        (32768, "config.json max_position_embeddings")
    assert context_length({}, {"model_max_length": 131072}) == (131072, "tokenizer_config.json model_max_length")
    assert context_length({}, {"model_max_length": 1e30}) == (LM_EVAL_MAX_LENGTH, "default")  # transformers' unset
