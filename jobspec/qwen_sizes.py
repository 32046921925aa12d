"""The released dense Qwen2.5 and Qwen3 sizes as config.json dicts, and docs/sizes.md's size table
(pure Python: the estimator of ``jobspec.memory`` and the choice of ``jobspec.layout_choice`` decide every row).

Sizes: hidden, layers, heads / KV heads, head_dim and tied embeddings as in the shared material's README
(``shared/README.md`` beside the project);
intermediate_size and vocab_size as in each model's published config.json (Qwen/Qwen2.5-*, Qwen/Qwen3-*
on the Hugging Face Hub).
"""
from __future__ import annotations

import math
from typing import Any

from jobspec.layout_choice import smallest_world
from jobspec.lora_config import LoraConfig
from jobspec.memory import FULL_FT, TrainShape
from jobspec.model_layout import param_count


def _cfg(model_type: str, vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int,
         tied: bool) -> dict[str, Any]:
    cfg = {"model_type": model_type, "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
           "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
           "tie_word_embeddings": tied}
    if model_type == "qwen3":
        cfg["head_dim"] = 128
    return cfg


SIZES: dict[str, dict[str, Any]] = {
    "Qwen2.5-0.5B": _cfg("qwen2", 151936, 896, 4864, 24, 14, 2, True),
    "Qwen2.5-1.5B": _cfg("qwen2", 151936, 1536, 8960, 28, 12, 2, True),
    "Qwen2.5-3B": _cfg("qwen2", 151936, 2048, 11008, 36, 16, 2, True),
    "Qwen2.5-7B": _cfg("qwen2", 152064, 3584, 18944, 28, 28, 4, False),
    "Qwen2.5-14B": _cfg("qwen2", 152064, 5120, 13824, 48, 40, 8, False),
    "Qwen2.5-32B": _cfg("qwen2", 152064, 5120, 27648, 64, 40, 8, False),
    "Qwen2.5-72B": _cfg("qwen2", 152064, 8192, 29568, 80, 64, 8, False),
    "Qwen3-0.6B": _cfg("qwen3", 151936, 1024, 3072, 28, 16, 8, True),
    "Qwen3-1.7B": _cfg("qwen3", 151936, 2048, 6144, 28, 16, 8, True),
    "Qwen3-4B": _cfg("qwen3", 151936, 2560, 9728, 36, 32, 8, True),
    "Qwen3-8B": _cfg("qwen3", 151936, 4096, 12288, 36, 32, 8, False),
    "Qwen3-14B": _cfg("qwen3", 151936, 5120, 17408, 40, 40, 8, False),
    "Qwen3-32B": _cfg("qwen3", 151936, 5120, 25600, 64, 64, 8, False),
}
TABLE_SEQ_LEN = 4096
NPUS_PER_NODE = 8


def size_table(seq_len: int = TABLE_SEQ_LEN) -> str:
    """Markdown: full fine-tune (bf16, micro batch 1, grad_accum 8, recompute, the ZeRO stage chosen as
    ``parallel.zero: auto`` does) and LoRA (``LoraConfig()``'s r 8 on all seven linear layers, as
    recipes/qwen-lora.yaml) of every size on 64 GB 910Bs: the fewest NPUs and the layout on them."""
    rows = ["| model | method | params | layout | NPUs | nodes | GiB per NPU | why |",
            "|---|---|---|---|---|---|---|---|"]
    for name, cfg in SIZES.items():
        params = f"{param_count(cfg) / 1e9:.2f} B"
        for method, shape in (("full", FULL_FT), ("LoRA", TrainShape(lora=LoraConfig()))):
            world, choice = smallest_world(cfg, seq_len=seq_len, npus_per_node=NPUS_PER_NODE, shape=shape)
            if not world:
                rows.append(f"| {name} | {method} | {params} | none up to 256 NPUs | - | - | - | {choice.why} |")
                continue
            total = choice.estimate.total if choice.estimate else 0  # a layout that fits has its estimate
            rows.append(f"| {name} | {method} | {params} | {choice.label} | {world} | "
                        f"{math.ceil(world / NPUS_PER_NODE)} | {total / 2**30:.1f} | {choice.why} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(size_table())
