"""Each cleaning rule: samples it must drop, samples it must keep, and the switch."""
from __future__ import annotations

import json

import pytest

from jobspec.config import CleanConfig
from jobspec.data.clean import dedup_key, text_rule, token_rule
from jobspec.data.formats import Sample
from jobspec.data.prepare import prepare
from tests.jobspec.data.data_helpers import cache_of, recipe_for, write_json


def s(q, a, bad=False, system=None):
    return Sample(system, (("user", q), ("assistant", a)), "t", bad)


CASES = [  # rule, switch, must drop, must keep
    ("empty_response", "empty_response", s("Say hi", "  \n\t"), s("Say hi", "hi")),
    ("repeat_prompt", "repeat_prompt", s("What is  AI?", "what is ai?"), s("What is AI?", "AI is a field of CS.")),
    ("repeated_chars", "repeated_chars", s("Wow", "Great!!!!!!!!!!!!!!"), s("Wow", "Great!!! Really great.")),
    ("repeated_chars", "repeated_chars", s("哈" * 30, "ok"), s("Code?", "x = 1\n\n        y = 2")),
    ("repeated_chars", "repeated_chars", s("Table", "a\n。。。。。。。。。。。。"),
     s("Table", "| a | b |\n|------------|:----------:|\n| 1 | 2 |\n==============")),
    ("mojibake", "mojibake", s("Hi", "\ufffd\ufffd\x07\ufffd ok"), s("Hi", "Hello \ufffd world, all fine here.")),
    ("invalid_utf8", "invalid_utf8", s("Hi", "caf\ufffd", bad=True), s("Hi", "café")),
]


@pytest.mark.parametrize("rule,switch,drop,keep", CASES)
def test_text_rules_drop_and_keep(rule, switch, drop, keep):
    cfg = CleanConfig()
    assert text_rule(drop, cfg) == rule
    assert text_rule(keep, cfg) is None
    off = CleanConfig(**{switch: False})
    assert text_rule(drop, off) != rule


def test_repeated_chars_threshold_is_configurable():
    sample = s("q", "Hmm.....")  # a run of 5
    assert text_rule(sample, CleanConfig(repeated_chars_max_run=4)) == "repeated_chars"
    assert text_rule(sample, CleanConfig(repeated_chars_max_run=5)) is None


def test_token_length_rules():
    cfg = CleanConfig(min_tokens=10, max_tokens=100)
    assert token_rule(9, cfg) == "too_short"
    assert token_rule(10, cfg) is None and token_rule(100, cfg) is None
    assert token_rule(101, cfg) == "too_long"
    assert token_rule(10**6, CleanConfig(max_tokens=0)) is None


def test_dedup_key_normalizes_case_and_whitespace_only():
    assert dedup_key(s("Hello  World", "Yes.")) == dedup_key(s("hello world", " yes. "))
    assert dedup_key(s("Hello World", "Yes.")) != dedup_key(s("Hello World", "No."))


def test_may_repeat_never_misses_a_run_the_regex_finds():
    """The chunk pre-check may say yes wrongly (the regex decides) but never no wrongly."""
    import random

    from jobspec.data.clean import _run_re, may_repeat

    rng = random.Random(0)
    samples = []
    for _ in range(2000):
        t = "".join(rng.choice("ab\n -=_x\u00e9") for _ in range(rng.randint(0, 40)))
        samples.append(Sample(rng.choice([None, "", "zz" + t[:5]]), (("user", t[::-1]), ("assistant", t)), "w"))
    for m in (1, 2, 3, 5):
        got = may_repeat(samples, m)
        exact = [bool(_run_re(m).search("\n".join([c for _, c in s.turns] + ([s.system] if s.system else []))))
                 for s in samples]
        assert sum(exact) > 0 or m == 5
        assert all(g or not e for g, e in zip(got, exact))
        assert sum(got) < len(samples)
    assert may_repeat([], 10) == []


def test_sharegpt_turns_out_of_order_are_dropped_and_counted(tmp_path):
    """issue 19.7: a conversation opening with an answer, or two questions in a row, was kept silently."""
    def conv(*turns):
        return {"conversations": [{"from": f, "value": v} for f, v in turns]}

    good = [conv(("human", f"What is {i} plus {i}?"), ("gpt", f"It is {2 * i}.")) for i in range(6)]
    bad = [conv(("gpt", "I answer first."), ("human", "Why?"), ("gpt", "Because.")),
           conv(("human", "One question."), ("human", "Another question."), ("gpt", "An answer."))]
    path = write_json(tmp_path / "chat.json", good + bad)
    info = prepare(*cache_of(recipe_for(tmp_path, [path])), progress=False)
    report = json.loads((info.dir / "data_report.json").read_text())
    assert report["dropped"]["role_order"]["count"] == 2 and info.num_samples == 6
    assert "turns out of order" in report["meaning"]["dropped.role_order"]
