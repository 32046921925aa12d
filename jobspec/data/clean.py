"""Rule-based cleaning (data.clean): each rule switchable, each drop counted under its name.

Text rules run before tokenization, token-length rules after, duplicates last (first one kept).
"""
from __future__ import annotations

import functools
import hashlib
import re

import numpy as np

from jobspec.config import CleanConfig
from jobspec.data.formats import Sample, is_text

# drop reasons, in the order they are checked (the report lists them in this order)
RULES = ("invalid_utf8", "role_order", "empty_response", "repeat_prompt", "repeated_chars", "mojibake",
         "too_short", "too_long", "cannot_fit", "dedup")

# control characters other than \t \n \r, DEL/C1 controls, U+FFFD, lone surrogates, private use
_BAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ufffd\ud800-\udfff\ue000-\uf8ff]")


def _norm(text: str) -> str:
    """Lower case, whitespace runs collapsed (the comparison key of repeat_prompt and dedup)."""
    return " ".join(text.split()).lower()


def _answers(s: Sample) -> list[str]:
    """What the model learns: the assistant turns (a plain-text document: the document)."""
    return [c for r, c in s.turns if r in ("assistant", "text")]


@functools.lru_cache(maxsize=8)
def _run_re(max_run: int) -> re.Pattern[str]:
    """A character repeated more than max_run times in a row (not spaces, nor the - = _ of
    Markdown tables and rules)."""
    return re.compile(r"([^\s\-=_])\1{" + str(max(max_run, 1)) + ",}")


def mojibake_ratio(text: str) -> float:
    """Share of non-printable / replacement characters in text."""
    if not text:
        return 0.0
    return len(_BAD.findall(text)) / len(text)


def _joined(s: Sample) -> str:
    return "\n".join([c for _, c in s.turns] + ([s.system] if s.system else []))


def may_repeat(samples: list[Sample], max_run: int) -> list[bool]:
    """Per sample: does its text hold a character repeated more than max_run times in a row?

    A cheap vectorised pre-check of repeated_chars over a whole chunk (any character, so a True
    still needs the exact regex; a False is final): the texts are joined by newlines, which
    no run of the rule can cross.
    """
    texts = [_joined(s) for s in samples]
    a = np.frombuffer("\n".join(texts).encode("utf-32-le", "surrogatepass"), dtype="<u4")
    m = max(max_run, 1)
    if len(a) <= m:
        return [False] * len(samples)
    c = np.r_[0, np.cumsum(a[1:] == a[:-1])]  # c[i]: equal neighbour pairs before position i
    hit = np.flatnonzero(c[m:] - c[:-m] == m)  # a[i..i+m] all equal
    if not len(hit):
        return [False] * len(samples)
    starts = np.cumsum([0] + [len(t) + 1 for t in texts[:-1]])
    out = np.zeros(len(samples), dtype=bool)
    out[np.searchsorted(starts, hit, side="right") - 1] = True
    return list(out.tolist())


def alternating(s: Sample) -> bool:
    """Whether the turns go user, assistant, user, assistant, ... (ShareGPT's rule, as LLaMA-Factory
    applies it: a conversation opening with an answer, or two questions in a row, is dropped)."""
    return all(role == ("user", "assistant")[i % 2] for i, (role, _) in enumerate(s.turns))


def text_rule(s: Sample, cfg: CleanConfig, run_possible: bool = True) -> str | None:
    """The first text rule that drops the sample, or None to keep it (``run_possible`` False: the
    sample is known to pass repeated_chars; plain-text documents are not checked for runs)."""
    if cfg.invalid_utf8 and s.bad_utf8:
        return "invalid_utf8"
    if not is_text(s) and not alternating(s):
        return "role_order"
    answers = _answers(s)
    if cfg.empty_response and (not answers or any(not a.strip() for a in answers)):
        return "empty_response"
    if cfg.repeat_prompt:
        prev = ""
        for role, content in s.turns:
            if role == "assistant" and prev and abs(len(content) - len(prev)) <= len(prev) // 2 \
                    and _norm(content) == _norm(prev):
                return "repeat_prompt"
            prev = content if role == "user" else prev
    run_possible = run_possible and not is_text(s)
    if not (cfg.mojibake or (cfg.repeated_chars and run_possible)):
        return None
    joined = _joined(s)
    if cfg.repeated_chars and run_possible and _run_re(cfg.repeated_chars_max_run).search(joined):
        return "repeated_chars"
    if cfg.mojibake and _BAD.search(joined) and mojibake_ratio(joined) > cfg.mojibake_max_ratio:
        return "mojibake"
    return None


def token_rule(n_tokens: int, cfg: CleanConfig) -> str | None:
    """too_short / too_long on the whole templated sample (before truncation)."""
    if n_tokens < cfg.min_tokens:
        return "too_short"
    if cfg.max_tokens and n_tokens > cfg.max_tokens:
        return "too_long"
    return None


def dedup_key(s: Sample) -> bytes:
    """Hash of the normalized prompt + response (all turns, in order; the tool schemas too)."""
    text = "\0".join(f"{role}\1{content.strip()}" for role, content in s.turns)
    if s.tools:
        text += f"\0tools\1{s.tools}"
    return hashlib.blake2b(_norm(text).encode("utf-8", "replace"), digest_size=16).digest()
