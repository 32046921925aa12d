"""The first training loss of a tiny Qwen3 as transformers computes it, for the end-to-end test
(tests/finetune/test_qwen3_train.py). Run with the reference venv, never by ``make test``:

    /work/refvenv/bin/python tools/make_qwen3_golden.py   # writes tests/finetune/golden/qwen3-e2e/golden.json

The model: ``jobspec.tiny`` with ``OVERRIDES`` (seed 0), which the test creates the same way; here
transformers builds a ``Qwen3ForCausalLM`` from its config, takes those weights and saves it, and the
saved tensors are checked equal to ``jobspec.tiny``'s (so the test's model is one transformers made).
The batch: the three samples of ``data.json`` encoded by prepare-data's own encoder for that model
directory (Qwen3's template, the default system prompt). With ``data.packing`` they share one row of 256
tokens, each attending only
to itself, so the first step's loss is the token-weighted mean of their losses whatever their order.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from jobspec.config import CleanConfig, DataConfig
from jobspec.data.encode import Encoder
from jobspec.data.formats import read_samples
from jobspec.tiny import TINY_DEFAULTS, ensure_tiny_model, random_weights

OUT = ROOT / "tests" / "finetune" / "golden" / "qwen3-e2e"
OVERRIDES = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "head_dim": 32, "attention_bias": False,
             "tie_word_embeddings": False}
SEQ_LEN = 256


def main() -> int:
    config = {**TINY_DEFAULTS, **OVERRIDES}
    weights = random_weights(config, seed=0)
    hf_cfg = transformers.Qwen3Config(**{k: v for k, v in config.items() if k not in ("architectures", "model_type",
                                                                                      "torch_dtype")},
                                      attn_implementation="eager")
    model = transformers.Qwen3ForCausalLM(hf_cfg).float().eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
        ensure_tiny_model(Path(tmp) / "m", OVERRIDES, 0)  # the test's model directory: its template, tokenizer
        samples = list(read_samples(OUT / "data.json", "alpaca"))
        enc = Encoder(str(Path(tmp) / "m" / "tokenizer.json"), DataConfig().system_prompt, SEQ_LEN,
                      CleanConfig())(samples)
    if saved.keys() != weights.keys() or any(not np.array_equal(saved[k], weights[k]) for k in saved):
        raise SystemExit("transformers' saved Qwen3 differs from jobspec.tiny's tensors")
    assert len(enc["kept"]) == 3 and sum(enc["lengths"]) <= SEQ_LEN, enc["reasons"]
    total, count, start = 0.0, 0, 0
    for n in enc["lengths"]:
        ids = torch.from_numpy(enc["tokens"][start:start + n].astype(np.int64))[None]
        labels = enc["labels"][start:start + n].astype(np.int64)
        start += n
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
        target = labels[1:]
        keep = np.flatnonzero(target != -100)
        total += float(-logp[keep, target[keep]].sum())
        count += len(keep)
    golden = {"first_loss": total / count, "label_tokens": count, "lengths": enc["lengths"], "overrides": OVERRIDES,
              "seq_len": SEQ_LEN}
    (OUT / "golden.json").write_text(json.dumps(golden, indent=2) + "\n")
    print(json.dumps(golden))
    return 0


if __name__ == "__main__":
    sys.exit(main())
