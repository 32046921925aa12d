"""Each cleaning rule: samples it must drop, samples it must keep, and the switch."""
from __future__ import annotations

import pytest

from finetune.config import CleanConfig
from finetune.data.clean import dedup_key, text_rule, token_rule
from finetune.data.formats import Sample


def s(q, a, bad=False, system=None):
    return Sample(system, (("user", q), ("assistant", a)), "t", bad)


CASES = [  # rule, switch, must drop, must keep
    ("empty_response", "empty_response", s("Say hi", "  \n\t"), s("Say hi", "hi")),
    ("repeat_prompt", "repeat_prompt", s("What is  AI?", "what is ai?"), s("What is AI?", "AI is a field of CS.")),
    ("repeated_chars", "repeated_chars", s("Wow", "Great!!!!!!!!!!!!!!"), s("Wow", "Great!!! Really great.")),
    ("repeated_chars", "repeated_chars", s("哈" * 30, "ok"), s("Code?", "x = 1\n\n        y = 2")),
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
