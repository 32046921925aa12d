"""Sample answers from a Hugging Face Qwen2 directory (e.g. the fine-tune's export).

    python finetune/generate.py --model-dir output/hf --prompt "What is the capital of France?"

Keys and values of earlier positions are cached: after the prompt each step runs one token.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # started as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from finetune.config import DataConfig  # noqa: E402
from finetune.data.formats import Sample  # noqa: E402
from finetune.data.template import render  # noqa: E402

SYSTEM_PROMPT = DataConfig().system_prompt  # the one the fine-tune trains with by default
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
ANSWER_HEADER = "<|im_start|>assistant\n"  # the template's generation prompt


def chat_prompt(turns: str | list[tuple[str, str]], system: str | None = None) -> str:
    """The training chat template (``data/template.py``) of a conversation (or one user prompt),
    ending where the assistant answers; ``system`` None: the training default."""
    turns = [("user", turns)] if isinstance(turns, str) else turns
    return render(Sample(system, tuple(turns), "prompt"), SYSTEM_PROMPT) + ANSWER_HEADER


def next_token(logits: np.ndarray, seen: list[int], temperature: float, top_p: float,
               repetition_penalty: float, rng: np.random.Generator) -> int:
    """Pick one token id from fp32 logits ``[vocab]`` (greedy when temperature == 0)."""
    logits = logits.astype(np.float64)
    if repetition_penalty != 1.0 and seen:
        ids = np.unique(np.asarray(seen))
        ids = ids[ids < logits.shape[0]]
        vals = logits[ids]
        logits[ids] = np.where(vals > 0, vals / repetition_penalty, vals * repetition_penalty)
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    cum = np.cumsum(probs[order])
    keep = order[: int(np.searchsorted(cum, top_p)) + 1]  # smallest set with mass >= top_p
    p = probs[keep] / probs[keep].sum()
    return int(keep[rng.choice(len(keep), p=p)])


def generate(model, tokenizer, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.7,
             top_p: float = 0.9, repetition_penalty: float = 1.1, seed: int = 0) -> list[int]:
    """New token ids after ``prompt_ids`` (stops after <|im_end|> or <|endoftext|>, not included)."""
    import mindspore as ms

    stops = {tokenizer.token_to_id(t) for t in STOP_TOKENS} - {None}
    rng = np.random.default_rng(seed)
    ids = list(prompt_ids)
    out: list[int] = []
    caches = model.new_caches()
    feed = ids  # the prompt first, then one token a step
    for _ in range(max_new_tokens):
        logits = model.last_logits(ms.Tensor(np.array([feed], np.int32)), caches).asnumpy()[0]
        tok = next_token(logits, ids, temperature, top_p, repetition_penalty, rng)
        if tok in stops:
            break
        ids.append(tok)
        out.append(tok)
        feed = [tok]
    return out


def load_model(model_dir: str, device_target: str = "CPU"):
    """A Qwen2ForCausalLM with the weights of an HF directory, and its tokenizer."""
    import mindspore as ms
    from tokenizers import Tokenizer

    from finetune.dist import RankInfo
    from finetune.hf_io import load_hf_config, load_weights
    from finetune.model import Qwen2Config, Qwen2ForCausalLM

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target=device_target)
    config = load_hf_config(model_dir)
    tok_file = Path(model_dir) / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(f"{tok_file}: not found; --model-dir needs the tokenizer files "
                                "(the fine-tune's export copies them)")
    model = Qwen2ForCausalLM(Qwen2Config.from_dict(config), RankInfo(device_target=device_target))
    load_weights(model, model_dir)
    return model, Tokenizer.from_file(str(tok_file))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="finetune.generate", description="Answer one prompt with an HF Qwen2 dir.")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7, help="0: greedy")
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--repetition-penalty", type=float, default=1.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--system", default=SYSTEM_PROMPT)
    ap.add_argument("--device", default="CPU", choices=["CPU", "Ascend"])
    args = ap.parse_args(argv)
    try:
        model, tokenizer = load_model(args.model_dir, args.device)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompt_ids = tokenizer.encode(chat_prompt(args.prompt, args.system), add_special_tokens=False).ids
    out = generate(model, tokenizer, prompt_ids, args.max_new_tokens, args.temperature, args.top_p,
                   args.repetition_penalty, args.seed)
    print(tokenizer.decode(out, skip_special_tokens=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
