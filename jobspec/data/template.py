"""Qwen2.5's and Qwen3's chat templates, labels and truncation on token ids.

Qwen2.5 text: ``<|im_start|>system\\n{system}<|im_end|>\\n`` (with tools: the system prompt, then the
tool schemas and the call instructions of Qwen2.5's tool template) then per turn
``<|im_start|>{role}\\n{content}<|im_end|>\\n`` (tool calls and tool results are already in the
turns' content, see ``formats.py``). Qwen3 (hybrid thinking) differs in three places: no system
block when the system prompt is empty; each assistant turn after the last user query opens with
``<think>\\n{reasoning}\\n</think>\\n\\n`` (the last one always, with empty reasoning when it has
none); earlier assistant turns lose their reasoning. Reasoning is the ``<think>...</think>`` that
opens an assistant turn's content (``formats.py`` writes ``reasoning_content`` there);
``data.thinking=drop`` removes it. The special tokens split the text before the byte-level
pre-tokenizer, so encoding the whole rendered text gives the ids that ``transformers``'
``apply_chat_template`` gives. Labels (aligned with input_ids; the model shifts) are -100 except
each assistant turn's content tokens (its reasoning included) and its ``<|im_end|>``.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from jobspec.data.formats import Sample
from jobspec.family import FAMILIES, family_in

if TYPE_CHECKING:
    from tokenizers import Tokenizer

IGNORE = -100
QWEN25, QWEN3 = FAMILIES["qwen2"].template, FAMILIES["qwen3"].template  # the two templates written below
TEMPLATE_VERSIONS = {QWEN25: "qwen2.5-chatml-v1", QWEN3: "qwen3-thinking-v1"}  # part of the cache fingerprint
TOOLS_HEAD = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
              "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
              "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
              "\"arguments\": <args-json-object>}\n</tool_call>")


def chat_format(tokenizer_path: str | Path) -> str:
    """The chat template of the model family whose config.json is beside the tokenizer (``Family.template``;
    QWEN25 for a tokenizer without config.json, the bundled one). Raises ValueError naming config.json when
    it is unreadable or of another family: no template of ours is that model's."""
    return family_in(Path(tokenizer_path).parent).template


def split_reasoning(content: str) -> tuple[str, str]:
    """(reasoning, answer) of an assistant turn, split at ``</think>`` as Qwen3's template splits it."""
    if "</think>" not in content:
        return "", content
    parts = content.split("</think>")
    return parts[0].rstrip("\n").split("<think>")[-1].lstrip("\n"), parts[-1].lstrip("\n")


def render(sample: Sample, default_system: str, fmt: str = QWEN25, thinking: str = "auto") -> str:
    """The templated text of one sample (no generation prompt)."""
    return render_system(sample, default_system, fmt) + render_turns(sample, fmt, thinking)


def render_system(sample: Sample, default_system: str, fmt: str = QWEN25) -> str:
    """The system block of the templated text (Qwen3: none when there is no system prompt nor tools)."""
    system = sample.system if sample.system is not None else default_system
    if fmt == QWEN3 and not system:
        return f"<|im_start|>system\n{TOOLS_HEAD[2:]}{sample.tools}{TOOLS_TAIL}<|im_end|>\n" if sample.tools else ""
    tools = f"{TOOLS_HEAD}{sample.tools}{TOOLS_TAIL}" if sample.tools else ""
    return f"<|im_start|>system\n{system}{tools}<|im_end|>\n"


def _is_query(role: str, content: str) -> bool:
    return role == "user" and not (content.startswith("<tool_response>") and content.endswith("</tool_response>"))


def render_turns(sample: Sample, fmt: str = QWEN25, thinking: str = "auto") -> str:
    """The templated text after the system block."""
    turns = sample.turns
    if fmt == QWEN3:
        last_query = max((i for i, (r, c) in enumerate(turns) if _is_query(r, c)), default=len(turns) - 1)
        out = []
        for i, (role, content) in enumerate(turns):
            if role == "assistant":
                reasoning, content = split_reasoning(content)
                reasoning = "" if thinking == "drop" else reasoning
                if i > last_query and (i == len(turns) - 1 or reasoning):
                    content = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{content}"
            out.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
        return "".join(out)
    if thinking == "drop":
        turns = tuple((r, split_reasoning(c)[1] if r == "assistant" else c) for r, c in turns)
    return "".join([f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns])


def splits_at_specials(tokenizer: Tokenizer) -> bool:
    """True when <|im_start|> / <|im_end|> cut the text into pieces that are encoded on their own
    (no lstrip / rstrip / single_word), so ids(system block + turns) = ids(system block) + ids(turns)."""
    for t in tokenizer.get_added_tokens_decoder().values():
        if t.content in ("<|im_start|>", "<|im_end|>") and (t.lstrip or t.rstrip or t.single_word):
            return False
    return True


class Specials:
    """Ids of the template's special tokens for one tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        ids = {t: tokenizer.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")}
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"tokenizer lacks {missing}: not a Qwen2/Qwen2.5 tokenizer.json")
        self.im_start, self.im_end, self.pad = ids["<|im_start|>"], ids["<|im_end|>"], ids["<|endoftext|>"]
        self.assistant = tokenizer.encode("assistant", add_special_tokens=False).ids[0]
        self.system = tokenizer.encode("system", add_special_tokens=False).ids[0]


def label_flat(ids: NDArray[Any], sp: Specials) -> NDArray[Any]:
    """Labels for a flat run of whole templated samples (vectorised over any number of them).

    A block starts at each <|im_start|>; in an assistant block every token from offset 3 (after
    ``<|im_start|>assistant\\n``) up to and including the block's first <|im_end|> is a label.
    """
    is_start = ids == sp.im_start
    block = np.cumsum(is_start) - 1  # block index of each token (-1 before the first start)
    starts = np.flatnonzero(is_start)
    pos = np.arange(len(ids))
    if len(starts) == 0:
        return np.full(len(ids), IGNORE, dtype=np.int32)
    b = np.maximum(block, 0)
    offset = pos - starts[b]
    role_pos = np.minimum(starts + 1, len(ids) - 1)
    is_asst_block = ids[role_pos] == sp.assistant
    is_end = ids == sp.im_end
    ends_before = np.cumsum(is_end) - is_end  # im_end count strictly before each token
    base = ends_before[starts]  # ... at each block start
    keep = (block >= 0) & is_asst_block[b] & (offset >= 3) & (ends_before == base[b])
    return np.where(keep, ids, IGNORE).astype(np.int32)


def blocks(ids: NDArray[Any], sp: Specials) -> list[tuple[int, int]]:
    """[start, end) of every <|im_start|>...<|im_end|>\\n block of one sample."""
    starts = np.flatnonzero(ids == sp.im_start).tolist()
    return list(zip(starts, starts[1:] + [len(ids)]))


def truncate(ids: NDArray[Any], labels: NDArray[Any], seq_len: int,
             sp: Specials) -> tuple[NDArray[Any], NDArray[Any]] | None:
    """Fit one sample into seq_len keeping the assistant part; None when it cannot fit.

    Drops the earliest (user, assistant) turn pairs first, then cuts the last user content and
    then the system content (if there is a system block) from the left. Never cuts an assistant turn.
    """
    if len(ids) <= seq_len:
        return ids, labels
    bl = blocks(ids, sp)
    head = bl[:1] if ids[bl[0][0] + 1] == sp.system else []
    turns = bl[len(head):]
    # the last user turn before the final assistant turn and everything after it must stay
    last_user = max((i for i in range(len(turns)) if ids[turns[i][0] + 1] != sp.assistant), default=0)
    keep_from = 0
    total = len(ids)
    while keep_from < last_user and total > seq_len:
        nxt = keep_from + 1
        while nxt < last_user and ids[turns[nxt][0] + 1] == sp.assistant:
            nxt += 1  # drop up to the next user turn
        total -= sum(e - s for s, e in turns[keep_from:nxt])
        keep_from = nxt
    kept = head + turns[keep_from:]
    excess = total - seq_len
    cuts = [0] * len(kept)
    # cut content from the left (the 3 header tokens, <|im_end|> and "\n" stay): the last user
    # turn first, then the system prompt
    for bi in ([len(head) + last_user - keep_from] if turns else []) + ([0] if head else []):
        s, e = kept[bi]
        if ids[s + 1] == sp.assistant:
            continue
        cuts[bi] = max(0, min((e - s) - 5, excess))
        excess -= cuts[bi]
    if excess > 0:
        return None
    idx = np.concatenate([np.r_[s:s + 3, s + 3 + c:e] for (s, e), c in zip(kept, cuts)])
    return ids[idx], labels[idx]
