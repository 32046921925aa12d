"""Qwen3's hybrid-thinking template: golden ids from transformers' apply_chat_template, reasoning
labels, data.thinking, the family in the cache identity, preflight's template check."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobspec.config import CleanConfig
from jobspec.data import cache
from jobspec.data.chat_template import check_model_template, model_template, render_hf
from jobspec.data.encode import Encoder
from jobspec.data.formats import Sample, alpaca_sample, sharegpt_sample
from jobspec.data.template import IGNORE, QWEN3, chat_format
from tests.jobspec.data.data_helpers import TOKENIZER, cache_of, qwen3_dir, recipe_for, write_jsonl

GOLDEN = json.loads((Path(__file__).parent / "golden_template_qwen3.json").read_text())


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return qwen3_dir(tmp_path_factory.mktemp("qwen3"))


def encode(model_dir: Path, sample: Sample, system: str = "You are a helpful assistant.", thinking: str = "auto",
           seq_len: int = 4096):
    res = Encoder(str(model_dir / "tokenizer.json"), system, seq_len, CleanConfig(), thinking)([sample])
    assert res["reasons"] == [None], res["reasons"]
    return res["tokens"], res["labels"]


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_ids_and_label_mask(model, name):
    g = GOLDEN[name]
    reader = alpaca_sample if "instruction" in g["record"] else sharegpt_sample
    ids, labels = encode(model, reader(g["record"], "golden"), g["system_prompt"], g["thinking"])
    assert ids.tolist() == g["input_ids"]
    assert (labels != IGNORE).astype(int).tolist() == g["label_mask"]
    assert labels[labels != IGNORE].tolist() == [i for i, m in zip(g["input_ids"], g["label_mask"]) if m]


def test_the_reasoning_of_the_trained_turn_is_learned_and_earlier_reasoning_is_gone(model):
    enc = Encoder(str(model / "tokenizer.json"), "", 4096, CleanConfig())
    ids, labels = encode(model, sharegpt_sample(GOLDEN["reasoning"]["record"], "r"), "")
    learned = enc.tok.decode(labels[labels != IGNORE].tolist(), skip_special_tokens=False)
    assert learned == "56.<|im_end|><think>\n56 / 4 = 14.\n</think>\n\n14.<|im_end|>"
    assert "7 * 8 = 56" not in enc.tok.decode(ids.tolist(), skip_special_tokens=False)
    think = enc.tok.token_to_id("<think>")
    assert think == 151667 and (ids == think).sum() == 1 and labels[ids == think].tolist() == [think]
    dropped, _ = encode(model, sharegpt_sample(GOLDEN["reasoning"]["record"], "r"), "", "drop")
    assert "56 / 4 = 14" not in enc.tok.decode(dropped.tolist(), skip_special_tokens=False)


def test_qwen25_keeps_inline_reasoning_as_text_unless_dropped():
    s = sharegpt_sample({"messages": [{"role": "user", "content": "q"},
                                      {"role": "assistant", "reasoning_content": "hmm", "content": "a"}]}, "r")
    assert s.turns[1] == ("assistant", "<think>\nhmm\n</think>\n\na")
    enc = Encoder(str(TOKENIZER), "S", 4096, CleanConfig(), "keep")
    text = enc.tok.decode(enc([s])["labels"][enc([s])["labels"] != IGNORE].tolist(), skip_special_tokens=False)
    assert text == "<think>\nhmm\n</think>\n\na<|im_end|>"
    drop = Encoder(str(TOKENIZER), "S", 4096, CleanConfig(), "drop")([s])
    assert drop["tokens"].tolist() == enc([s._replace(turns=(("user", "q"), ("assistant", "a")))])["tokens"].tolist()


def test_truncation_without_a_system_block_keeps_the_answer(model):
    long_q = " ".join(f"w{i}" for i in range(300))
    s = Sample(None, (("user", long_q), ("assistant", "<think>sum</think>The answer is 42.")), "t")
    full, full_lab = encode(model, s, "")
    ids, lab = encode(model, s, "", seq_len=48)
    assert len(full) > 48 and len(ids) == 48
    assert lab[lab != IGNORE].tolist() == full_lab[full_lab != IGNORE].tolist()
    assert ids[:3].tolist() == full[:3].tolist() and ids[-20:].tolist() == full[-20:].tolist()


def test_the_family_is_part_of_the_cache_identity(model, tmp_path):
    assert chat_format(model / "tokenizer.json") == QWEN3 and chat_format(TOKENIZER) == "qwen2.5"
    rec = recipe_for(tmp_path, [write_jsonl(tmp_path / "d.jsonl", [{"instruction": "q", "output": "a"}])])
    q25 = qwen3_dir(tmp_path / "q25")
    (q25 / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    a, b = cache.settings_of(rec.data, model / "tokenizer.json"), cache.settings_of(rec.data, q25 / "tokenizer.json")
    assert a["template"] != b["template"] and a["tokenizer_sha256"] == b["tokenizer_sha256"]
    assert "thinking" not in a
    rec.data.thinking = "drop"
    assert cache.settings_of(rec.data, model / "tokenizer.json")["thinking"] == "drop"


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_render_hf_gives_the_text_of_transformers(model, name):
    g = GOLDEN[name]
    assert render_hf(model_template(model), g["messages"], g["tools"]) == g["text"]


def test_preflight_check_of_a_qwen3_dir_with_the_released_template(model, tmp_path):
    status, line = check_model_template(model, "You are a helpful assistant.")
    assert status == "same", line
    changed = qwen3_dir(tmp_path / "changed")
    cfg = json.loads((changed / "tokenizer_config.json").read_text())
    cfg["chat_template"] = cfg["chat_template"].replace("if message.reasoning_content is string", "if false")
    (changed / "tokenizer_config.json").write_text(json.dumps(cfg))
    status, line = check_model_template(changed, "You are a helpful assistant.")
    assert status == "differs" and "with reasoning" in line and "Qwen3's format" in line, line


def test_prepare_data_writes_qwen3s_template_and_data_thinking_chooses_the_reasoning(model, tmp_path):
    from jobspec.data.prepare import prepare

    data = write_jsonl(tmp_path / "r.jsonl", [GOLDEN["reasoning"]["record"]] * 2)
    want = {t: len(GOLDEN[n]["input_ids"]) for t, n in (("auto", "reasoning"), ("drop", "reasoning_dropped"))}
    for thinking, n in want.items():
        info = prepare(*cache_of(recipe_for(tmp_path / thinking, [data], thinking=thinking), model / "tokenizer.json"),
                       progress=False)
        assert info.manifest["settings"]["template"] == "qwen3-thinking-v1" and info.num_tokens == n


def test_data_thinking_is_validated():
    from jobspec.config import ConfigError
    from jobspec.recipe_load import load_recipe

    with pytest.raises(ConfigError, match="data.thinking='think'"):
        load_recipe(raw={"model": {"init": {}}}, overrides={"data.thinking": "think"})
