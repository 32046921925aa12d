"""Answer prompts with a Hugging Face Qwen2/Qwen2.5/Qwen3 directory (e.g. the fine-tune's export) to check a model.

    python finetune/generate.py --model-dir output/hf --prompt "What is the capital of France?" --prompt "2+2?"
    python finetune/generate.py --model-dir output/hf --input prompts.jsonl --output answers.jsonl
    python finetune/generate.py --model-dir output/hf --chat

Prompts are rendered with the training chat template of the model's family (``data/template.py``:
Qwen3's for a Qwen3 config.json, else Qwen2.5's; a config.json of another family is refused) and answered in
batches (left-padded); keys and values of earlier positions are cached, so after the prompt each
step runs one token per row. Sampling defaults come from the model's ``generation_config.json``;
flags override them. The device is chosen like training's (an NPU when one is present).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if __package__ in (None, ""):  # started as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from jobspec.config import DataConfig
from jobspec.data.formats import Sample
from jobspec.data.template import QWEN25, render
from jobspec.family import Family, family_in
from jobspec.recipe_parse import Problem

if TYPE_CHECKING:  # imported where used: the CLI answers its argument errors before loading MindSpore
    from tokenizers import Tokenizer

    from finetune.dist import RankInfo
    from finetune.model.decoder import DecoderLM

SYSTEM_PROMPT = DataConfig().system_prompt  # the one the fine-tune trains with by default
ANSWER_HEADER = "<|im_start|>assistant\n"  # the template's generation prompt
Turns = list[tuple[str, str]]


@dataclass
class Sampling:
    """How tokens are picked; ``temperature`` 0 is greedy. Defaults are transformers' (but 512 new tokens)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 50
    repetition_penalty: float = 1.0
    max_new_tokens: int = 512
    seed: int = 0

    @classmethod
    def of_model(cls, model_dir: str | Path) -> Sampling:
        """From ``generation_config.json`` (``do_sample: false`` means greedy); defaults where absent."""
        path = Path(model_dir) / "generation_config.json"
        cfg = json.loads(path.read_text()) if path.is_file() else {}
        known = {f.name for f in dataclasses.fields(cls)}
        s = cls(**{k: v for k, v in cfg.items() if k in known and v is not None})
        if not cfg.get("do_sample", False):  # transformers' default: greedy
            s.temperature = 0.0
        return s


def chat_prompt(turns: str | Turns, system: str | None = None, fmt: str = QWEN25) -> str:
    """The training chat template (``data/template.py``; ``fmt``: the model's, ``chat_format``) of a
    conversation (or one user prompt), ending where the assistant answers; ``system`` None: the training default."""
    turns = [("user", turns)] if isinstance(turns, str) else turns
    return render(Sample(system, tuple(turns), "prompt"), SYSTEM_PROMPT, fmt) + ANSWER_HEADER


def next_token(logits: np.ndarray, seen: list[int], temperature: float, top_p: float,
               repetition_penalty: float, rng: np.random.Generator, top_k: int = 0) -> int:
    """Pick one token id from fp32 logits ``[vocab]`` (greedy when temperature == 0; top_k 0: all)."""
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
    order = np.argsort(-probs, kind="stable")
    if 0 < top_k < len(order):
        order = order[:top_k]
    probs = probs[order] / probs[order].sum()
    keep = min(int(np.searchsorted(np.cumsum(probs), top_p)) + 1, len(probs))  # smallest set with mass >= top_p
    p = probs[:keep] / probs[:keep].sum()
    return int(order[rng.choice(keep, p=p)])


def stop_ids(tokenizer, model_dir: str | Path) -> set[int]:
    """The model family's stop tokens (``Family.stop_tokens``) and the model's ``eos_token_id``(s)."""
    out = {tokenizer.token_to_id(t) for t in family_in(model_dir).stop_tokens} - {None}
    path = Path(model_dir) / "generation_config.json"
    eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    return out | set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def generate(model, prompts: list[list[int]], stops: set[int], s: Sampling, pad_id: int = 0,
             finished: Callable[[list[int]], bool] | None = None) -> list[list[int]]:
    """New token ids after each prompt (one batch, left-padded); a row ends at a stop token (not included)
    or once ``finished`` says so of its new tokens."""
    import mindspore as ms

    rng = np.random.default_rng(s.seed)
    width = max(len(p) for p in prompts)
    pad = np.array([width - len(p) for p in prompts], np.int32)
    feed = np.array([[pad_id] * n + p for n, p in zip(pad, prompts)], np.int32)
    keys = np.arange(width)[None, :] >= pad[:, None]
    seen = [list(p) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    done = np.zeros(len(prompts), bool)
    caches = model.new_caches()
    for _ in range(s.max_new_tokens):
        logits = model.last_logits(ms.Tensor(feed), caches, pad, keys).asnumpy()
        step = np.full(len(prompts), pad_id, np.int32)
        for i in np.flatnonzero(~done):
            tok = next_token(logits[i], seen[i], s.temperature, s.top_p, s.repetition_penalty, rng, s.top_k)
            if tok in stops:
                done[i] = True
                continue
            step[i] = tok
            seen[i].append(tok)
            out[i].append(tok)
            done[i] = finished is not None and finished(out[i])
        if done.all():
            break
        feed, keys = step[:, None], np.concatenate([keys, ~done[:, None]], 1)
    return out


def check_weights_before_build(model_dir: str | Path) -> dict:
    """The config of ``model_dir`` once its weight files hold every tensor in the right shape."""
    from finetune.io.hf_io import check_weights, load_hf_config
    from jobspec.model_layout import full_shapes

    config = load_hf_config(model_dir)
    check_weights(model_dir, full_shapes(config))
    return config


def load_model(model_dir: str | Path, device: str = "auto", rank: RankInfo | None = None
               ) -> tuple[DecoderLM, Tokenizer, str]:
    """(DecoderLM with the weights of an HF directory, its tokenizer, device target); ``rank``: the TP slices
    of an initialised rank (``finetune.dist.init_distributed``), else a whole model."""
    import mindspore as ms
    from tokenizers import Tokenizer

    from finetune.dist import RankInfo, set_device
    from finetune.io.hf_io import load_weights
    from finetune.model.decoder import DecoderLM, ModelConfig, compute_dtype
    from jobspec.platform import platform_of

    tok_file = Path(model_dir) / "tokenizer.json"
    config = check_weights_before_build(model_dir)
    if not tok_file.is_file():
        raise FileNotFoundError(f"{tok_file}: not found; the model directory needs the tokenizer files "
                                "(the fine-tune's export copies them)")
    platform = platform_of(device)
    target = platform.target
    ms.set_context(mode=ms.PYNATIVE_MODE)
    if rank is None:
        set_device(target, None)
    model = DecoderLM(ModelConfig.from_dict(config), rank or RankInfo(device_target=target),
                             compute_dtype=compute_dtype(platform.default_precision))
    load_weights(model, model_dir)
    return model, Tokenizer.from_file(str(tok_file)), target


def read_prompts(path: str | Path) -> list[dict]:
    """Conversations from a JSONL file (``messages`` [{role, content}], ``prompt``, or ``instruction``
    [+ ``input``], optional ``system``) or a text file (one prompt a line)."""
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if Path(path).suffix != ".jsonl":
            out.append({"turns": [("user", line)], "system": None, "record": {"prompt": line}})
            continue
        try:
            r = json.loads(line)
            if "messages" in r:
                msgs = r["messages"]
                system = next((m["content"] for m in msgs if m["role"] == "system"), None)
                turns = [(m["role"], m["content"]) for m in msgs if m["role"] != "system"]
            else:
                text = r["prompt"] if "prompt" in r else "\n\n".join(x for x in (r["instruction"], r.get("input")) if x)
                turns, system = [("user", text)], r.get("system")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: not a prompt record ({e}); one JSON object a line with "
                             "\"prompt\", \"instruction\" or \"messages\"") from None
        out.append({"turns": turns, "system": system, "record": r})
    return out


def answer(model, tokenizer, convs: list[dict], s: Sampling, stops: set[int], batch_size: int, *, family: Family,
           progress: Callable[[str], None] | None = None) -> list[str]:
    """The assistant's answer to each conversation in the model ``family``'s chat format, in batches of
    ``batch_size`` (``progress``: told after each)."""
    pad, fmt = tokenizer.token_to_id(family.pad_token) or 0, family.template
    texts = []
    for a in range(0, len(convs), batch_size):
        part = convs[a:a + batch_size]
        ids = [tokenizer.encode(chat_prompt(c["turns"], c["system"], fmt), add_special_tokens=False).ids for c in part]
        texts += [tokenizer.decode(o, skip_special_tokens=True) for o in generate(model, ids, stops, s, pad)]
        if progress is not None:
            progress(f"{len(texts)}/{len(convs)} answered")
    return texts


def pick_model(args: argparse.Namespace) -> tuple[Path, str]:
    """(model directory, what it is): ``--model-dir``, else with ``--adapter`` or ``--base`` the base model, else the
    fine-tuned one."""
    if args.model_dir:
        return Path(args.model_dir), "the model"
    if args.adapter and args.base_model:  # never the run's hf/: with export.merge it holds the adapter already
        return Path(args.base_model), "the base model"
    if args.base and args.base_model:
        return Path(args.base_model), "the base model (--base)"
    if args.finetuned and (Path(args.finetuned) / "config.json").is_file():
        return Path(args.finetuned), "the fine-tuned model"
    raise ValueError(f"no fine-tuned model at {args.finetuned or '(none given)'}: train first (make train), or "
                     "export a checkpoint (python -m launcher export --checkpoint step_N); --base answers with the "
                     "base model" + (f" {args.base_model}" if args.base_model else " (with --base-model DIR)"))


def chat(model, tokenizer, s: Sampling, stops: set[int], system: str | None, family: Family) -> None:
    """A multi-turn conversation in the terminal; /reset starts over, /exit or Ctrl-D ends."""
    turns: Turns = []
    print("chat: /reset starts over, /exit or Ctrl-D ends", file=sys.stderr)
    while True:
        try:
            text = input("you> ").strip()
        except EOFError:
            print()
            return
        if text == "/exit":
            return
        if text == "/reset" or not text:
            turns = [] if text else turns
            continue
        turns.append(("user", text))
        reply = answer(model, tokenizer, [{"turns": turns, "system": system}], s, stops, 1, family=family)[0]
        turns.append(("assistant", reply))
        print(f"assistant> {reply}", flush=True)


def sample_check(model, config_dir: Path, recipe, rank, out: Path) -> Path | None:
    """The post-training inference check: answer ``export.check_prompts`` with the trained model
    (in memory, every rank in step: the TP groups compute the same logits and draw the same tokens
    from ``config_dir``'s generation_config.json), with its tokenizer (the base model's, which the export
    copies: every node has it, whether or not the export is on shared storage); rank 0 writes
    ``out`` (the run's ``samples.jsonl``). Returns its path on rank 0; None when off or without prompts."""
    from tokenizers import Tokenizer

    from jobspec.data.files import resolve_path

    if not recipe.export.check_prompts:
        return None
    prompts = resolve_path(recipe.export.check_prompts)
    if not prompts.is_file():
        rank.log(f"[train] inference check skipped: export.check_prompts={recipe.export.check_prompts} not found")
        return None
    convs = read_prompts(prompts)
    for c in convs:
        c["system"] = c["system"] if c["system"] is not None else recipe.data.system_prompt
    tokenizer = Tokenizer.from_file(str(Path(config_dir) / "tokenizer.json"))
    s = dataclasses.replace(Sampling.of_model(config_dir), max_new_tokens=recipe.export.check_max_new_tokens,
                            seed=recipe.train.seed)
    rank.log(f"[train] inference check: answering {len(convs)} prompts of {prompts} (up to {s.max_new_tokens} new "
             "tokens each)")
    texts = answer(model, tokenizer, convs, s, stop_ids(tokenizer, config_dir), 8,
                   family=family_in(config_dir),
                   progress=lambda done: rank.log(f"[train] inference check: {done}"))
    if not rank.is_main:
        return None
    out.write_text("".join(json.dumps({**c["record"], "response": t}, ensure_ascii=False) + "\n"
                           for c, t in zip(convs, texts)), encoding="utf-8")
    rank.log(f"[train] inference check: {len(texts)} answers from the fine-tuned model in {out}")
    return out


# option -> (whether a value is allowed, what is allowed, a value that works)
LIMITS = {"temperature": (lambda v: v >= 0, "must be >= 0 (0: greedy)", "0.7"),
          "top_p": (lambda v: 0 < v <= 1, "must be in (0, 1]", "0.9"),
          "top_k": (lambda v: v >= 0, "must be >= 0 (0: no limit)", "50"),
          "repetition_penalty": (lambda v: v > 0, "must be > 0 (1: none)", "1.1"),
          "max_new_tokens": (lambda v: v >= 1, "must be >= 1", "256"),
          "batch_size": (lambda v: v >= 1, "must be >= 1", "8")}


def option_problems(args: argparse.Namespace) -> list[Problem]:
    """Every bad option, checked before the model loads (nothing generated is then lost)."""
    out = [Problem("--" + k.replace("_", "-"), why, example, str(getattr(args, k)))
           for k, (ok, why, example) in LIMITS.items() if getattr(args, k) is not None and not ok(getattr(args, k))]
    if args.output and not Path(args.output).resolve().parent.is_dir():
        out.append(Problem("--output", f"its directory {Path(args.output).resolve().parent} does not exist; create "
                           "it first", "answers.jsonl", args.output))
    elif args.output and Path(args.output).is_dir():
        out.append(Problem("--output", "is a directory; give a file", f"{args.output}/answers.jsonl", args.output))
    if args.input and not Path(args.input).is_file():
        out.append(Problem("--input", "no such file", "prompts.jsonl", args.input))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="finetune.generate", description=__doc__.split("\n\n")[0])
    src = ap.add_argument_group("model (one of)")
    src.add_argument("--model-dir", help="a Hugging Face Qwen2 directory")
    src.add_argument("--finetuned", help="the fine-tune's export (refused when missing unless --base)")
    src.add_argument("--base-model", help="the base model, used with --base")
    src.add_argument("--base", action="store_true", help="answer with the base model when no fine-tuned one exists")
    src.add_argument("--adapter", help="a LoRA adapter in peft's format (OUTPUT_DIR/adapter), applied to the model "
                     "without merging")
    io = ap.add_argument_group("prompts (one of)")
    io.add_argument("--prompt", action="append", default=[], help="a user prompt; repeat for several")
    io.add_argument("--input", help="JSONL (prompt / instruction / messages) or text file (one prompt a line)")
    io.add_argument("--chat", action="store_true", help="an interactive multi-turn chat")
    ap.add_argument("--output", help="write JSONL answers here (default: print them)")
    ap.add_argument("--system", default=None, help=f"system prompt (default: {SYSTEM_PROMPT!r})")
    ap.add_argument("--batch-size", type=int, default=8, help="prompts answered together")
    ap.add_argument("--device", default="auto", choices=["auto", "npu", "cpu"], help="auto: an NPU when present")
    smp = ap.add_argument_group("sampling (defaults: the model's generation_config.json)")
    for f in dataclasses.fields(Sampling):
        smp.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=None,
                         help="0: greedy" if f.name == "temperature" else None)
    args = ap.parse_args(argv)
    if sum(bool(x) for x in (args.prompt, args.input, args.chat)) != 1:
        ap.error("give --prompt (repeatable), --input FILE or --chat")
    problems = option_problems(args)
    if problems:
        print("error: invalid options, nothing loaded:\n" + "\n".join(f"  - {p.text()}" for p in problems),
              file=sys.stderr)
        return 2
    try:
        model_dir, what = pick_model(args)
        convs = read_prompts(args.input) if args.input else \
            [{"turns": [("user", p)], "system": args.system, "record": {"prompt": p}} for p in args.prompt]
        s = dataclasses.replace(Sampling.of_model(model_dir), **{f.name: getattr(args, f.name)
                                                                 for f in dataclasses.fields(Sampling)
                                                                 if getattr(args, f.name) is not None})
        family = family_in(model_dir)  # before the model loads: an unknown family is refused
        if args.adapter:
            from finetune.io.lora_io import check_adapter_base

            check_adapter_base(args.adapter, model_dir)
        model, tokenizer, target = load_model(model_dir, args.device)
        if args.adapter:
            from finetune.io.lora_io import load_adapter

            load_adapter(model, args.adapter)
            what += f" with the LoRA adapter {args.adapter}"
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[generate] {what}: {model_dir.resolve()} on {target}; {s}", file=sys.stderr)
    stops = stop_ids(tokenizer, model_dir)
    if args.chat:
        chat(model, tokenizer, s, stops, args.system, family)
        return 0
    for c in convs:
        c["system"] = c["system"] if c["system"] is not None else args.system
    texts = answer(model, tokenizer, convs, s, stops, args.batch_size, family=family)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            for c, t in zip(convs, texts):
                fh.write(json.dumps({**c["record"], "response": t}, ensure_ascii=False) + "\n")
        print(f"[generate] {len(texts)} answers written to {args.output}", file=sys.stderr)
    else:
        for t in texts:
            print(t + ("\n" if len(texts) > 1 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
