"""Golden numbers from Hugging Face transformers for the model parity tests.

Run with the reference venv (torch + transformers), never by ``make test``:

    /work/refvenv/bin/python tools/make_golden.py            # writes tests/finetune/golden/
    /work/refvenv/bin/python tools/make_golden.py --cases qwen3-tied qwen3-untied   # only these
    /work/refvenv/bin/python tools/make_golden.py --check DIR --case tied
        # loads an HF dir we exported with transformers and compares its logits to the golden ones

Each case is a tiny Qwen2 or Qwen3 (GQA 4 heads / 2 KV heads; Qwen3: head_dim 16, not hidden/heads)
with seeded weights saved as HF safetensors, run with ``attn_implementation="eager"`` in fp32 on
fixed input ids.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jobspec.tiny import random_weights

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "finetune" / "golden"
BASE = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 88, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 128, "bos_token_id": 1, "eos_token_id": 2}
QWEN3 = {**BASE, "model_type": "qwen3", "head_dim": 16, "attention_bias": False}
CASES = {"tied": {**BASE, "tie_word_embeddings": True, "rope_theta": 1000000.0},
         "untied": {**BASE, "tie_word_embeddings": False, "rope_theta": 10000.0},
         "qwen3-tied": {**QWEN3, "tie_word_embeddings": True, "rope_theta": 1000000.0},
         "qwen3-untied": {**QWEN3, "tie_word_embeddings": False, "rope_theta": 10000.0}}
SEEDS = {"tied": 7, "untied": 8, "qwen3-tied": 17, "qwen3-untied": 18}
GRAD_PARAMS = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
               "model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.weight",
               "model.layers.1.self_attn.v_proj.bias", "model.layers.1.self_attn.o_proj.weight",
               "model.layers.1.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight",
               "model.norm.weight", "model.layers.0.self_attn.q_norm.weight",
               "model.layers.1.self_attn.k_norm.weight"]  # those the case's model has
HF_CLASSES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


def inputs() -> tuple[np.ndarray, np.ndarray]:
    """Fixed input ids [2, 12] and labels with some -100 (prompt masking and a hole)."""
    rng = np.random.default_rng(1234)
    ids = rng.integers(0, BASE["vocab_size"], (2, 12)).astype(np.int64)
    labels = ids.copy()
    labels[0, :4] = -100
    labels[1, :7] = -100
    labels[1, 9] = -100
    return ids, labels


def build(case: str) -> transformers.PreTrainedModel:
    cfg = dict(CASES[case])
    weights = random_weights(cfg, seed=SEEDS[case], std=0.1)
    rng = np.random.default_rng(99)
    for name, w in weights.items():  # non-trivial norms and biases so their handling is tested
        if name.endswith("norm.weight") or name.endswith(".bias"):
            weights[name] = (w + rng.normal(0, 0.1, w.shape)).astype(np.float32)
    config_cls, model_cls = HF_CLASSES[cfg.pop("model_type", "qwen2")]
    hf_cfg = getattr(transformers, config_cls)(**cfg, attn_implementation="eager")
    model = getattr(transformers, model_cls)(hf_cfg).float().eval()
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise SystemExit(f"weights do not match: missing {missing} unexpected {unexpected}")
    if cfg["tie_word_embeddings"]:
        model.tie_weights()
    return model


def make(case: str) -> None:
    model = build(case)
    out_dir = GOLDEN / case
    model.save_pretrained(out_dir, safe_serialization=True)
    ids, labels = inputs()
    out = model(input_ids=torch.from_numpy(ids), labels=torch.from_numpy(labels))
    out.loss.backward()
    named = dict(model.named_parameters())
    grads = {f"grad/{n}": named[n].grad.numpy() for n in GRAD_PARAMS if n in named}
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())).item()
    np.savez_compressed(out_dir / "golden.npz", input_ids=ids, labels=labels,
                        logits=out.logits.detach().numpy(), loss=np.float32(out.loss.item()),
                        grad_norm=np.float32(norm), **grads)
    print(f"{case}: loss {out.loss.item():.6f} grad norm {norm:.6f} -> {out_dir}")
    if case == "tied":  # the same weights as transformers writes them in bf16 (sharded), for the reader test
        model.to(torch.bfloat16).save_pretrained(GOLDEN / "tied-bf16", safe_serialization=True,
                                                 max_shard_size="40KB")


def check(model_dir: str, case: str) -> int:
    """Logits of an exported dir (loaded by transformers) against the golden ones."""
    g = np.load(GOLDEN / case / "golden.npz")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(g["input_ids"])).logits.numpy()
    diff = float(np.abs(logits - g["logits"]).max())
    print(json.dumps({"model_dir": model_dir, "case": case, "max_abs_diff": diff,
                      "config_dtype": str(model.config.dtype)}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", metavar="DIR", help="compare an exported HF dir with the golden logits")
    ap.add_argument("--case", choices=sorted(CASES), default="tied")
    ap.add_argument("--cases", nargs="+", choices=sorted(CASES), default=sorted(CASES), help="the goldens to write")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    if args.check:
        return check(args.check, args.case)
    for case in args.cases:
        make(case)
    return 0


if __name__ == "__main__":
    sys.exit(main())
