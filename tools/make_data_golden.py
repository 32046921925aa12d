"""Golden token ids and label masks for the Qwen2.5 chat template (with tools), from transformers.

    python -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install transformers tokenizers jinja2
    /tmp/hfvenv/bin/python tools/make_data_golden.py   # writes tests/jobspec/data/golden_template.json

The ids come from ``apply_chat_template(messages, tools=...)`` on the bundled tokenizer
(assets/tokenizer), whose tokenizer_config.json carries the Qwen2.5-Instruct chat template with its
tool part, as a released Qwen2.5-Instruct directory does. The label mask is derived independently of
our code: for each assistant turn, the tokens between the prompt rendered with
``add_generation_prompt=True`` and the end of that turn's ``<|im_end|>``.
"""
from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "finetune" / "data" / "golden_template.json"
SYSTEM = "You are a helpful assistant."
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "城市名"},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city"]}}}
TIME = {"name": "get_time", "description": "Local time in a time zone.",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}


def _call(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


CASES = {
    "alpaca": {
        "record": {"system": "You are a careful translator.", "instruction": "Translate to French:",
                   "input": "Good morning, friends!", "output": "Bonjour, les amis !"},
        "messages": [{"role": "system", "content": "You are a careful translator."},
                     {"role": "user", "content": "Translate to French:\nGood morning, friends!"},
                     {"role": "assistant", "content": "Bonjour, les amis !"}],
    },
    "sharegpt": {
        "record": {"conversations": [
            {"from": "human", "value": "什么是光合作用？"},
            {"from": "gpt", "value": "光合作用是植物利用光能把二氧化碳和水转化为葡萄糖的过程。"},
            {"from": "human", "value": "Give one example, briefly."},
            {"from": "gpt", "value": "A leaf of a tomato plant  in sunlight.\n\nIt makes sugar."}]},
        "messages": [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": "什么是光合作用？"},
                     {"role": "assistant", "content": "光合作用是植物利用光能把二氧化碳和水转化为葡萄糖的过程。"},
                     {"role": "user", "content": "Give one example, briefly."},
                     {"role": "assistant", "content": "A leaf of a tomato plant  in sunlight.\n\nIt makes sugar."}],
    },
    # LLaMA-Factory's ShareGPT tool format: function_call / observation turns, tools as JSON text
    "sharegpt_tools": {
        "record": {"conversations": [
            {"from": "human", "value": "北京现在多少度？"},
            {"from": "function_call", "value": json.dumps({"name": "get_weather",
                                                           "arguments": {"city": "北京", "unit": "C"}},
                                                          ensure_ascii=False)},
            {"from": "observation", "value": "{\"temperature\": 21, \"sky\": \"晴\"}"},
            {"from": "gpt", "value": "北京现在 21°C，晴。"}],
            "tools": json.dumps([WEATHER["function"], TIME], ensure_ascii=False)},
        "tools": [WEATHER["function"], TIME],
        "messages": [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": "北京现在多少度？"},
                     {"role": "assistant", "content": None,
                      "tool_calls": [_call("get_weather", {"city": "北京", "unit": "C"})]},
                     {"role": "tool", "content": "{\"temperature\": 21, \"sky\": \"晴\"}"},
                     {"role": "assistant", "content": "北京现在 21°C，晴。"}],
    },
    # OpenAI messages: text beside two parallel calls (arguments as JSON text), two tool results
    "openai_tools": {
        "record": {"messages": [
            {"role": "system", "content": "You plan trips."},
            {"role": "user", "content": "Weather in Paris and the time there?"},
            {"role": "assistant", "content": "Let me check both.", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": "{\"city\": \"Paris\"}"}},
                {"id": "c2", "type": "function", "function": {"name": "get_time",
                                                              "arguments": "{\"tz\": \"Europe/Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "18 C, cloudy"},
            {"role": "tool", "tool_call_id": "c2", "content": "14:05"},
            {"role": "assistant", "content": "Paris: 18 C and cloudy; it is 14:05 there."},
            {"role": "user", "content": "Thanks!"}],
            "tools": [WEATHER, {"type": "function", "function": TIME}]},
        "tools": [WEATHER, {"type": "function", "function": TIME}],
        "messages": [{"role": "system", "content": "You plan trips."},
                     {"role": "user", "content": "Weather in Paris and the time there?"},
                     {"role": "assistant", "content": "Let me check both.",
                      "tool_calls": [_call("get_weather", {"city": "Paris"}),
                                     _call("get_time", {"tz": "Europe/Paris"})]},
                     {"role": "tool", "content": "18 C, cloudy"},
                     {"role": "tool", "content": "14:05"},
                     {"role": "assistant", "content": "Paris: 18 C and cloudy; it is 14:05 there."}],
    },
}


def main() -> None:
    tok = AutoTokenizer.from_pretrained(str(ROOT / "assets" / "tokenizer"))
    out = {}
    for name, case in CASES.items():
        msgs, tools = case["messages"], case.get("tools")

        def ids(m, gen=False, tools=tools):  # this case's tools
            r = tok.apply_chat_template(m, tools=tools, tokenize=True, add_generation_prompt=gen)
            return list(r["input_ids"] if hasattr(r, "keys") else r)

        full = ids(msgs)
        mask = [0] * len(full)
        for k, m in enumerate(msgs):
            if m["role"] == "assistant":
                prompt, upto = ids(msgs[:k], gen=True), ids(msgs[:k + 1])
                assert full[:len(prompt)] == prompt and full[:len(upto)] == upto, name
                end = len(upto) - 1  # the trailing "\n" after <|im_end|> is not a label
                mask[len(prompt):end] = [1] * (end - len(prompt))
        out[name] = {"record": case["record"], "system_prompt": SYSTEM, "input_ids": full, "label_mask": mask,
                     "text": tok.apply_chat_template(msgs, tools=tools, tokenize=False),
                     "messages": msgs, "tools": tools}
    OUT.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
