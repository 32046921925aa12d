"""Qwen2.5 template: golden ids from transformers' apply_chat_template, labels, truncation."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jobspec.config import CleanConfig
from jobspec.data.encode import Encoder
from jobspec.data.formats import Sample, alpaca_sample, sharegpt_sample
from jobspec.data.template import IGNORE
from tests.jobspec.data.data_helpers import TOKENIZER

GOLDEN = json.loads((Path(__file__).parent / "golden_template.json").read_text())


def encoder(seq_len=4096, **clean):
    return Encoder(str(TOKENIZER), "You are a helpful assistant.", seq_len, CleanConfig(**clean))


def one(enc, sample):
    res = enc([sample])
    assert res["reasons"] == [None], res["reasons"]
    return res["tokens"], res["labels"]


@pytest.mark.parametrize("name,reader", [("alpaca", alpaca_sample), ("sharegpt", sharegpt_sample),
                                         ("sharegpt_tools", sharegpt_sample), ("openai_tools", sharegpt_sample)])
def test_golden_ids_and_label_mask(name, reader):
    g = GOLDEN[name]
    ids, labels = one(encoder(), reader(g["record"], "golden"))
    assert ids.tolist() == g["input_ids"]
    mask = (labels != IGNORE).astype(int).tolist()
    assert mask == g["label_mask"]
    assert labels[labels != IGNORE].tolist() == [i for i, m in zip(g["input_ids"], g["label_mask"]) if m]


@pytest.mark.parametrize("name", ["sharegpt_tools", "openai_tools"])
def test_tool_calls_are_learned_and_tool_responses_are_not(name):
    enc = encoder()
    ids, labels = one(enc, sharegpt_sample(GOLDEN[name]["record"], "golden"))
    call = enc.tok.token_to_id("<tool_call>")
    in_system = np.flatnonzero(ids == enc.sp.im_end)[0]  # the tool instructions show <tool_call> too
    calls = np.flatnonzero(ids == call)
    assert len(calls[calls > in_system]) >= 1 and (labels[calls[calls > in_system]] == call).all()
    text = enc.tok.decode(ids.tolist(), skip_special_tokens=False)
    assert text.count("<tool_response>") >= 1
    learned = enc.tok.decode(labels[labels != IGNORE].tolist(), skip_special_tokens=False)
    assert "<tool_response>" not in learned and "get_weather" in learned


def _sample(turns, system=None):
    return Sample(system, tuple(turns), "t")


def test_truncation_cuts_user_content_from_the_left_and_keeps_the_answer():
    enc = encoder()
    long_q = " ".join(f"w{i}" for i in range(300))
    s = _sample([("user", long_q), ("assistant", "The final answer is 42.")])
    full_ids, full_lab = one(enc, s)
    ids, lab = one(encoder(seq_len=64), s)
    assert len(full_ids) > 64 and len(ids) == 64
    keep = full_lab != IGNORE
    assert lab[lab != IGNORE].tolist() == full_lab[keep].tolist()  # every answer token kept
    assert ids[-12:].tolist() == full_ids[-12:].tolist()
    assert ids[:3].tolist() == full_ids[:3].tolist()  # headers stay


def test_truncation_drops_earliest_turns_first():
    enc = encoder(seq_len=80)
    first = " ".join(["old"] * 60)
    s = _sample([("user", first), ("assistant", "first answer"), ("user", "new question"),
                 ("assistant", "second answer")])
    ids, lab = one(enc, s)
    text = enc.tok.decode(ids.tolist(), skip_special_tokens=False)
    assert "old" not in text and "first answer" not in text
    assert enc.tok.decode(lab[lab != IGNORE].tolist(), skip_special_tokens=False) == "second answer<|im_end|>"


def test_sample_whose_answer_cannot_fit_is_dropped():
    enc = encoder(seq_len=32)
    res = enc([_sample([("user", "q"), ("assistant", " ".join(["long"] * 60))]),
               _sample([("user", "q"), ("assistant", "short")])])
    assert res["reasons"] == ["cannot_fit", None]
    assert res["kept"] == [1]


def test_system_prompt_default_and_per_sample():
    enc = encoder()
    a, _ = one(enc, _sample([("user", "q"), ("assistant", "a")]))
    b, _ = one(enc, _sample([("user", "q"), ("assistant", "a")], system="Be brief."))
    assert "You are a helpful assistant." in enc.tok.decode(a.tolist())
    assert "Be brief." in enc.tok.decode(b.tolist()) and not np.array_equal(a, b)


def test_truncation_cuts_the_system_prompt_after_the_user_content():
    enc = encoder(seq_len=40)
    s = _sample([("user", "hello there"), ("assistant", "ans one two")], system=" ".join(["sys"] * 30))
    ids, lab = one(enc, s)
    text = enc.tok.decode(ids.tolist(), skip_special_tokens=False)
    assert len(ids) == 40 and "hello there" not in text
    assert text.startswith("<|im_start|>system\n sys") and text.endswith("assistant\nans one two<|im_end|>\n")


def test_a_tool_conversation_too_long_is_dropped_whole_never_cut():
    rec = GOLDEN["openai_tools"]["record"]
    full = len(GOLDEN["openai_tools"]["input_ids"])
    res = encoder(seq_len=full - 5)([sharegpt_sample(rec, "long")])
    assert res["reasons"] == ["cannot_fit"] and res["truncated"] == 0 and res["sizes"] == {0: full}
    assert one(encoder(seq_len=full), sharegpt_sample(rec, "fits"))[0].tolist() == GOLDEN["openai_tools"]["input_ids"]
