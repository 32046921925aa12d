"""Golden token ids and label masks for the Qwen2.5 chat template, from transformers.

    /tmp/refvenv/bin/python tools/make_data_golden.py   # writes tests/finetune/data/golden_template.json

The ids come from ``apply_chat_template`` on the bundled tokenizer (assets/tokenizer) with the
Qwen2.5 chat template (its no-tools part, set here because the bundled tokenizer_config has none).
The label mask is derived independently of our code: for each assistant turn, the tokens between
the prompt rendered with ``add_generation_prompt=True`` and the end of that turn's ``<|im_end|>``.
"""
from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "finetune" / "data" / "golden_template.json"
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

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
        "messages": [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "什么是光合作用？"},
                     {"role": "assistant", "content": "光合作用是植物利用光能把二氧化碳和水转化为葡萄糖的过程。"},
                     {"role": "user", "content": "Give one example, briefly."},
                     {"role": "assistant", "content": "A leaf of a tomato plant  in sunlight.\n\nIt makes sugar."}],
    },
}


def main() -> None:
    tok = AutoTokenizer.from_pretrained(str(ROOT / "assets" / "tokenizer"))
    out = {}
    for name, case in CASES.items():
        msgs = case["messages"]

        def ids(m, gen=False):
            r = tok.apply_chat_template(m, chat_template=QWEN25_TEMPLATE, tokenize=True,
                                        add_generation_prompt=gen)
            return list(r["input_ids"] if hasattr(r, "keys") else r)

        full = ids(msgs)
        mask = [0] * len(full)
        for k, m in enumerate(msgs):
            if m["role"] == "assistant":
                start = len(ids(msgs[:k], gen=True))
                end = len(ids(msgs[:k + 1])) - 1  # the trailing "\n" after <|im_end|> is not a label
                mask[start:end] = [1] * (end - start)
        out[name] = {"record": case["record"], "system_prompt": "You are a helpful assistant.",
                     "input_ids": full, "label_mask": mask,
                     "text": tok.apply_chat_template(msgs, chat_template=QWEN25_TEMPLATE, tokenize=False)}
    OUT.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
