"""Golden numbers from transformers + peft for the LoRA parity tests (tests/finetune/lora/).

Run with the reference venv (torch, transformers, peft), never by ``make test``:

    /work/refvenv/bin/python tools/make_lora_golden.py                # writes tests/finetune/lora/golden/
    /work/refvenv/bin/python tools/make_lora_golden.py --check DIR    # loads our exported adapter dir with
        # PeftModel.from_pretrained over the golden base and compares its logits to ours (DIR/logits.npy)
    /work/refvenv/bin/python tools/make_lora_golden.py --check-merged DIR  # the same for a merged hf/ dir

The base is the "untied" tiny Qwen2 of tools/make_golden.py (tests/finetune/golden/untied); the adapters
(r 4, alpha 8, dropout 0, all seven linear layers) get fixed seeded A and B (B non-zero, so every
gradient is non-trivial). Saved: the loss, logits, every adapter gradient and the weights after one
torch AdamW step with clipping (lr 1e-2, betas 0.9/0.999, eps 1e-6, weight decay 0.01, clip 1.0).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import peft
import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "tests" / "finetune" / "golden" / "untied"
GOLDEN = ROOT / "tests" / "finetune" / "lora" / "golden"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
R, ALPHA = 4, 8
OPT = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.01}
CLIP = 1.0


def base_model() -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def lora_model() -> tuple[peft.PeftModel, dict[str, np.ndarray]]:
    """The peft model with seeded A, B; and those weights by our names (module path + .lora_A.weight)."""
    cfg = peft.LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS, bias="none",
                          task_type="CAUSAL_LM")
    model = peft.get_peft_model(base_model(), cfg)
    rng = np.random.default_rng(2024)
    ours = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.from_numpy(rng.normal(0, 0.1, tuple(p.shape)).astype(np.float32)))
                ours[our_name(name)] = p.detach().numpy().copy()
    return model, ours


def our_name(peft_name: str) -> str:
    """base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight -> model.layers.0....lora_A.weight"""
    return peft_name.removeprefix("base_model.model.").replace(".default.", ".")


def make() -> None:
    g = np.load(BASE / "golden.npz")
    model, init = lora_model()
    model.train()
    ids, labels = torch.from_numpy(g["input_ids"]), torch.from_numpy(g["labels"])
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    named = {our_name(n): p for n, p in model.named_parameters() if p.requires_grad}
    assert len(named) == 2 * len(TARGETS) * model.config.num_hidden_layers, sorted(named)
    grads = {f"grad/{n}": p.grad.numpy().copy() for n, p in named.items()}
    opt = torch.optim.AdamW(list(named.values()), **OPT)
    torch.nn.utils.clip_grad_norm_(list(named.values()), CLIP)
    opt.step()
    GOLDEN.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(GOLDEN / "golden.npz", loss=np.float32(out.loss.item()), logits=out.logits.detach().numpy(),
                        **{f"init/{n}": v for n, v in init.items()}, **grads,
                        **{f"step/{n}": p.detach().numpy() for n, p in named.items()})
    print(f"loss {out.loss.item():.6f}, {len(named)} adapter tensors -> {GOLDEN}")


def check(adapter_dir: str, merged: bool) -> int:
    """Logits of our exported adapter (peft) or merged dir (transformers) vs ours (DIR/logits.npy)."""
    g = np.load(BASE / "golden.npz")
    model = (transformers.AutoModelForCausalLM.from_pretrained(adapter_dir, dtype=torch.float32,
                                                               attn_implementation="eager") if merged
             else peft.PeftModel.from_pretrained(base_model(), adapter_dir)).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(g["input_ids"])).logits.numpy()
    ours = np.load(Path(adapter_dir) / "logits.npy")
    print(json.dumps({"dir": adapter_dir, "merged": merged, "max_abs_diff": float(np.abs(logits - ours).max())}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", metavar="DIR", help="load our adapter dir with PeftModel.from_pretrained")
    ap.add_argument("--check-merged", metavar="DIR", help="load our merged hf dir with transformers")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    if args.check or args.check_merged:
        return check(args.check or args.check_merged, merged=bool(args.check_merged))
    make()
    return 0


if __name__ == "__main__":
    sys.exit(main())
