"""Golden token ids and label masks for Qwen3's hybrid-thinking chat template, from transformers.

    /work/refvenv/bin/python tools/make_qwen3_template_golden.py [QWEN3_TOKENIZER_DIR]
    # writes tests/jobspec/data/golden_template_qwen3.json

The ids come from ``apply_chat_template(messages, tools=...)`` on a released Qwen3 tokenizer directory
(default /work/shared/fixtures/qwen3-tokenizer). The label mask is derived from the rendered text, not
from our code: every token from after ``<|im_start|>assistant\\n`` up to and including that turn's
``<|im_end|>`` (by the tokenizer's character offsets). It also checks that the tests' Qwen3 tokenizer
(the bundled Qwen2.5 tokenizer.json plus the added tokens, ``data_helpers.qwen3_tokenizer_json``)
equals the released tokenizer.json.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.jobspec.data.data_helpers import qwen3_tokenizer_json

OUT = ROOT / "tests" / "finetune" / "data" / "golden_template_qwen3.json"
SYSTEM = "You are a helpful assistant."
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "城市名"}},
                   "required": ["city"]}}}


def _call(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


REASONED = {"messages": [
    {"role": "user", "content": "What is 7 * 8?"},
    {"role": "assistant", "reasoning_content": "7 * 8 = 56.", "content": "56."},
    {"role": "user", "content": "And 56 / 4?"},
    {"role": "assistant", "reasoning_content": "\n56 / 4 = 14.\n", "content": "\n14."}]}
# (record as prepare-data reads it, system_prompt, data.thinking, transformers' messages, tools)
CASES = {
    "alpaca": ({"instruction": "Translate to French:", "input": "Good morning!", "output": "Bonjour !"}, SYSTEM,
               "auto", [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "Translate to French:\nGood morning!"},
                        {"role": "assistant", "content": "Bonjour !"}], None),
    "multi_turn_no_system": (
        {"conversations": [{"from": "human", "value": "什么是光合作用？"}, {"from": "gpt", "value": "植物把光变成糖。"},
                           {"from": "human", "value": "One example?"}, {"from": "gpt", "value": "A tomato leaf."}]},
        "", "auto", [{"role": "user", "content": "什么是光合作用？"},
                     {"role": "assistant", "content": "植物把光变成糖。"},
                     {"role": "user", "content": "One example?"}, {"role": "assistant", "content": "A tomato leaf."}],
        None),
    "tools": (
        {"messages": [{"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "content": "Checking.", "tool_calls": [
                          {"type": "function",
                           "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                      {"role": "tool", "content": "18 C"}, {"role": "tool", "content": "cloudy"},
                      {"role": "assistant", "content": "18 C and cloudy."}], "tools": [WEATHER]},
        SYSTEM, "auto", [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": "Checking.",
                          "tool_calls": [_call("get_weather", {"city": "Paris"})]},
                         {"role": "tool", "content": "18 C"}, {"role": "tool", "content": "cloudy"},
                         {"role": "assistant", "content": "18 C and cloudy."}], [WEATHER]),
    "tools_no_system": (
        {"messages": [{"role": "user", "content": "Weather in Oslo?"},
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                      {"role": "tool", "content": "-3 C"}, {"role": "assistant", "content": "-3 C."}],
         "tools": [WEATHER]},
        "", "auto", [{"role": "user", "content": "Weather in Oslo?"},
                     {"role": "assistant", "content": None, "tool_calls": [_call("get_weather", {"city": "Oslo"})]},
                     {"role": "tool", "content": "-3 C"}, {"role": "assistant", "content": "-3 C."}], [WEATHER]),
    "reasoning": (REASONED, SYSTEM, "auto", [{"role": "system", "content": SYSTEM}, *REASONED["messages"]], None),
    "reasoning_dropped": (REASONED, SYSTEM, "drop", [{"role": "system", "content": SYSTEM}] + [
        {k: v for k, v in m.items() if k != "reasoning_content"} for m in REASONED["messages"]], None),
    # (no case of reasoning before a tool call: ShareGPT cannot write it without two assistant turns in a row,
    # which prepare-data drops as role_order, as LLaMA-Factory does)
}


def label_mask(tok, text: str) -> tuple[list[int], list[int]]:
    """(ids, mask) of the rendered text; mask 1 on the tokens of each assistant turn after its header,
    through its <|im_end|>."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = [(m.end(), text.index("<|im_end|>", m.end()) + len("<|im_end|>"))
             for m in re.finditer(re.escape("<|im_start|>assistant\n"), text)]
    mask = [int(any(a <= s < b for a, b in spans)) for s, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def main() -> None:
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "/work/shared/fixtures/qwen3-tokenizer")
    assert qwen3_tokenizer_json() == json.loads((src / "tokenizer.json").read_text()), "tests' tokenizer differs"
    tok = AutoTokenizer.from_pretrained(str(src))
    out = {}
    for name, (record, system, thinking, messages, tools) in CASES.items():
        text = tok.apply_chat_template(messages, tools=tools, tokenize=False)
        r = tok.apply_chat_template(messages, tools=tools, tokenize=True)
        ids, mask = label_mask(tok, text)
        assert ids == list(r["input_ids"] if hasattr(r, "keys") else r), name
        out[name] = {"record": record, "system_prompt": system, "thinking": thinking, "messages": messages,
                     "tools": tools, "text": text, "input_ids": ids, "label_mask": mask}
    OUT.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
