"""Rule-based cleaning (data.clean): each rule switchable, each drop counted under its name.

Text rules run before tokenization, token-length rules after, duplicates last (first one kept).
"""
from __future__ import annotations

import hashlib
import re
import unicodedata

from finetune.config import CleanConfig
from finetune.data.formats import Sample

# drop reasons, in the order they are checked (the report lists them in this order)
RULES = ("invalid_utf8", "empty_response", "repeat_prompt", "repeated_chars", "mojibake",
         "too_short", "too_long", "cannot_fit", "dedup")

_WS = re.compile(r"\s+")
# control characters other than \t \n \r, DEL/C1 controls, U+FFFD, lone surrogates, private use
_BAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ufffd\ud800-\udfff\ue000-\uf8ff]")


def _norm(text: str) -> str:
    return _WS.sub(" ", unicodedata.normalize("NFKC", text)).strip().lower()


def _answers(s: Sample) -> list[str]:
    return [c for r, c in s.turns if r == "assistant"]


def mojibake_ratio(text: str) -> float:
    """Share of non-printable / replacement characters in text."""
    if not text:
        return 0.0
    return len(_BAD.findall(text)) / len(text)


def text_rule(s: Sample, cfg: CleanConfig) -> str | None:
    """The first text rule that drops the sample, or None to keep it."""
    if cfg.invalid_utf8 and s.bad_utf8:
        return "invalid_utf8"
    answers = _answers(s)
    if cfg.empty_response and (not answers or any(not a.strip() for a in answers)):
        return "empty_response"
    if cfg.repeat_prompt:
        prev = ""
        for role, content in s.turns:
            if role == "assistant" and prev and _norm(content) == _norm(prev):
                return "repeat_prompt"
            prev = content if role == "user" else prev
    texts = [c for _, c in s.turns] + ([s.system] if s.system else [])
    if cfg.repeated_chars:
        run = re.compile(r"(\S)\1{%d,}" % max(cfg.repeated_chars_max_run, 1))
        if any(run.search(t) for t in texts):
            return "repeated_chars"
    if cfg.mojibake:
        joined = "".join(texts)
        if _BAD.search(joined) and mojibake_ratio(joined) > cfg.mojibake_max_ratio:
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
    """Hash of the normalized prompt + response (all turns, in order)."""
    h = hashlib.blake2b(digest_size=16)
    for role, content in s.turns:
        h.update(role.encode())
        h.update(_norm(content).encode("utf-8", "replace"))
        h.update(b"\0")
    return h.digest()
