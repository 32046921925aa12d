"""Training speed: our trainer's step against transformers + torch eager on the same model and batch.

    make bench-train                       # Qwen2 hidden 512, 4 layers, FFN 1408, vocab 151936, untied
    make bench-train BENCH_ARGS="--shape big"   # hidden 1024, 8 layers, FFN 2816, 16 / 2 heads
    python tools/bench_train.py --rounds 4 --torch-python /path/to/venv/bin/python --json out.json
    python tools/bench_train.py --paths ours-opbyop --breakdown   # one path, split into phases
    make bench-train METHOD=lora           # LoRA: ours against our full fine-tuning and transformers + peft

Both load the same seeded weights (fp32) and train on the same micro-batch (4 x 256 tokens, every
token labelled) with AdamW. Steps are interleaved over ``--rounds`` rounds: ours as a run trains by
default (``ours-default``: the recipe's ``train.compile_layers`` auto, compiled layers on CPU), torch,
ours op by op (``ours-opbyop``), torch; torch in its own process (``--torch-python``). Prints per path
the median over rounds of the tokens/s ratio to torch with its min/max, the CPU model and flags, cores
and load average. The validity check is about other work: a thread samples, every 0.25 s, the runnable
threads of processes outside this benchmark's process tree (``bench_conditions.OtherWork``); when they
average more than 0.5 no ratio is reported (NOT VALID). (The 1-minute load average, printed too, counts
the benchmark's own threads: about 2 on an idle 2-core machine.) A tool, not a test.

``--method lora``: our LoRA step (``train.method=lora``, the ``lora`` defaults: r 8, alpha 16, dropout 0.05,
all seven linear layers; compiled layers by default) and our default full step, each followed by a
transformers + peft step with the same LoRA config; per round the ratio of LoRA to the full step of that
round (``ratio_to_full``) and to peft.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # started as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_conditions import (
    LoadWatch,
    OtherWork,
    by_path,
    cpu_info,
    interleave,
    other_runnable,
    ratio_stats,
    read_loadavg,
)

SHAPE = {"vocab_size": 151936, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 2, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
         "max_position_embeddings": 4096, "tie_word_embeddings": False, "model_type": "qwen2",
         "architectures": ["Qwen2ForCausalLM"]}
# --shape NAME: the issue-23 shapes; --hidden/--layers/... change single fields
SHAPES = {"bench": {}, "big": {"hidden_size": 1024, "num_hidden_layers": 8, "intermediate_size": 2816,
                               "num_attention_heads": 16, "num_key_value_heads": 2}}
FIELDS = {"vocab": "vocab_size", "hidden": "hidden_size", "layers": "num_hidden_layers", "ffn": "intermediate_size",
          "heads": "num_attention_heads", "kv_heads": "num_key_value_heads"}
LR = 1e-5

TORCH_WORKER = r'''
import json, sys, time
import numpy as np
import torch, transformers

model_dir, batch_file, method = sys.argv[1], sys.argv[2], sys.argv[4]
b = np.load(batch_file)
ids, labels = torch.from_numpy(b["ids"].astype(np.int64)), torch.from_numpy(b["labels"].astype(np.int64))
model = transformers.Qwen2ForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
info = {}
if method == "lora":
    import peft
    model = peft.get_peft_model(model, peft.LoraConfig(**json.loads(sys.argv[5])))
    info["peft"] = peft.__version__
model.train()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=float(sys.argv[3]), weight_decay=0.0)
print(json.dumps({"ready": True, "threads": torch.get_num_threads(), "torch": torch.__version__,
                  "transformers": transformers.__version__, **info}), flush=True)
for line in sys.stdin:
    t = time.perf_counter()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    value = float(loss)
    print(json.dumps({"s": time.perf_counter() - t, "loss": value}), flush=True)
'''


def write_model(path: Path, shape: dict, seed: int = 0) -> None:
    """The benchmark model as a Hugging Face directory with seeded fp32 weights."""
    from safetensors.numpy import save_file

    from jobspec.tiny import random_weights

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**shape, "torch_dtype": "float32"}, indent=1))
    save_file(random_weights(shape, seed), str(path / "model.safetensors"))


def make_batch(batch: int, seq: int, vocab: int, seed: int = 1) -> dict[str, np.ndarray]:
    """One micro-batch of random token ids, every token labelled, one sequence per row."""
    ids = np.random.default_rng(seed).integers(0, vocab, (batch, seq)).astype(np.int32)
    return {"ids": ids, "labels": ids.copy(), "pos": np.tile(np.arange(seq, dtype=np.int32), (batch, 1)),
            "seg": np.ones_like(ids)}


def write_inputs(tmp: Path, batch: int, seq: int, shape: dict | None = None) -> dict[str, np.ndarray]:
    """The model in ``tmp/model`` and the micro-batch in ``tmp/batch.npz``; returns the batch."""
    shape = shape or SHAPE
    write_model(tmp / "model", shape)
    arrays = make_batch(batch, seq, shape["vocab_size"])
    np.savez(tmp / "batch.npz", **arrays)
    return arrays


class Ours:
    """Our trainer's step: the model and optimizer as ``finetune.run.training`` builds them (training mode,
    ``train.compile_layers`` from its path in ``PATHS``, None: the recipe's default), value_and_grad of the
    scaled loss (train.accumulate; LoRA's dropout masks advanced per step as the trainer does) and the AdamW
    step; ``method``: train.method (lora: the recipe's ``lora`` defaults)."""

    def __init__(self, model_dir: Path, batch: dict[str, np.ndarray], jit_layers: bool | None, method: str = "full"):
        import mindspore as ms

        from finetune.dist import init_distributed
        from finetune.parallel.overlap import GradReduction
        from finetune.run.training import build_model, build_optimizer
        from jobspec.recipe_load import load_recipe

        ms.set_context(mode=ms.PYNATIVE_MODE)
        self.ms = ms
        compile_layers = {} if jit_layers is None else {"train.compile_layers": jit_layers}
        recipe = load_recipe("tiny-cpu", {"model.dir": str(model_dir), "train.lr": LR, "train.weight_decay": 0.0,
                                          "train.clip_grad": 0.0, "train.method": method, **compile_layers}
                             ).resolved(1, "cpu")
        self.compiled = bool(recipe.train.compile_layers)
        rank = init_distributed(recipe.decided_layout)  # one process, as finetune.run.loop starts one
        self.model, self.params = build_model(recipe, rank, model_dir, ms.float32)  # as the trainer builds it
        self.opt = build_optimizer(self.params, recipe.train, rank, False)
        self.reduction = GradReduction(self.params, self.opt, overlap=False)  # one process: nothing to overlap
        self.mb = {"input_ids": batch["ids"], "labels": batch["labels"], "position_ids": batch["pos"],
                   "segment_ids": batch["seg"]}
        n = int((batch["labels"][:, 1:] != -100).sum())
        self.scale = ms.Tensor(1.0 / n, ms.float32)
        self.grad_fn = ms.value_and_grad(lambda *a: self.model(*a[:-1]) * a[-1], None, self.params)

    def step(self) -> tuple[float, float]:
        """(seconds, mean loss) of one training step."""
        from finetune.run.loop import accumulate

        t = time.perf_counter()
        masks = getattr(self.model, "lora_masks", None)  # as Training.scaled_loss: this step's dropout masks
        if masks is not None:
            masks.advance(masks.step + 1, self.mb["input_ids"].shape)
        grads, loss = accumulate(self.grad_fn, [self.mb], self.scale, self.reduction)
        self.opt.apply(grads, LR)
        value = float(loss.asnumpy())
        return time.perf_counter() - t, value

    def breakdown(self) -> dict[str, float]:
        """Seconds of the forward alone, forward + backward, and the optimizer step."""
        ms = self.ms
        args = [ms.Tensor(self.mb[k], ms.int32) for k in ("input_ids", "labels", "position_ids", "segment_ids")]
        t0 = time.perf_counter()
        self.model(*args).asnumpy()
        t1 = time.perf_counter()
        _, grads = self.grad_fn(*args, self.scale)
        grads[0].asnumpy()
        t2 = time.perf_counter()
        self.opt.step(list(grads), LR)
        t3 = time.perf_counter()
        return {"forward": t1 - t0, "forward+backward": t2 - t1, "optimizer": t3 - t2}


class Torch:
    """transformers + torch eager in its own process, one step per request (``method`` lora: peft's
    LoRA with our recipe's ``lora`` defaults)."""

    def __init__(self, python: str, model_dir: Path, batch_file: Path, script: Path, method: str = "full"):
        script.write_text(TORCH_WORKER)
        self.proc = subprocess.Popen([python, str(script), str(model_dir), str(batch_file), str(LR), method,
                                      json.dumps(peft_kwargs())],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = json.loads(self.proc.stdout.readline())

    def step(self) -> tuple[float, float]:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        r = json.loads(self.proc.stdout.readline())
        return r["s"], r["loss"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def peft_kwargs() -> dict[str, object]:
    """peft.LoraConfig arguments equal to our recipe's ``lora`` defaults."""
    from jobspec.lora_config import LoraConfig

    c = LoraConfig()
    return {"r": c.r, "lora_alpha": c.alpha, "lora_dropout": c.dropout, "target_modules": list(c.target_modules),
            "bias": c.bias, "use_rslora": c.use_rslora, "task_type": "CAUSAL_LM"}


def torch_available(python: str, method: str = "full") -> str:
    """'' when ``python`` imports torch and transformers (and peft for LoRA), else why not."""
    r = subprocess.run([python, "-c", "import torch, transformers" + (", peft" if method == "lora" else "")],
                       capture_output=True, text=True)
    return "" if r.returncode == 0 else (r.stderr.strip().splitlines() or ["import failed"])[-1]


# our paths -> (train.compile_layers: None is the recipe's default, train.method)
PATHS: dict[str, tuple[bool | None, str]] = {"ours-default": (None, "full"), "ours-opbyop": (False, "full"),
                                             "ours-compiled": (True, "full"), "ours-lora": (None, "lora")}
DEFAULT_PATHS = {"full": "ours-default,ours-opbyop", "lora": "ours-lora,ours-default"}
FULL_OF_LORA = "ours-default"  # LoRA's ratio_to_full is taken against this path


def summarize(times: dict[str, list[float]], after: dict[str, list[float]], tokens: int,
              invalid: str, method: str = "full") -> dict[str, object]:
    """Per path the median tokens/s; per our path of the torch side's ``method`` also the median ratio to
    torch over rounds and its min/max, each round's step against the torch step run right after it
    (``after[path]``); with LoRA and the full path timed, LoRA's ratio to the full step of each round
    (``ratio_to_full``); no ratio when ``invalid``."""
    out: dict[str, object] = {"valid": not invalid, "why_invalid": invalid}
    for name, secs in times.items():
        entry: dict[str, object] = {"tokens_per_s_median": tokens / float(np.median(secs))}
        if after.get(name) and not invalid and PATHS[name][1] == method:
            entry["ratio_to_torch"] = ratio_stats(secs, after[name])
        if name == "ours-lora" and times.get(FULL_OF_LORA) and not invalid:
            entry["ratio_to_full"] = ratio_stats(secs, times[FULL_OF_LORA])
        out[name] = entry
    return out


def main(argv: list[str] | None = None, loadavg=read_loadavg, other_sampler=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_train", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="timed rounds (after one warm-up round)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--torch-python", default=sys.executable, help="interpreter with torch + transformers")
    ap.add_argument("--method", default="full", choices=list(DEFAULT_PATHS),
                    help="lora: our LoRA step against our full step and transformers + peft")
    ap.add_argument("--paths", default=None, help=f"our paths to time, of {', '.join(PATHS)} (default: "
                    + "; ".join(f"{m}: {p}" for m, p in DEFAULT_PATHS.items()) + ")")
    ap.add_argument("--breakdown", action="store_true", help="also time our forward, backward and optimizer")
    ap.add_argument("--shape", default="bench", choices=list(SHAPES),
                    help="bench: hidden 512, 4 layers; big: hidden 1024, 8 layers, FFN 2816, 16 / 2 heads")
    for flag, key in FIELDS.items():
        ap.add_argument(f"--{flag.replace('_', '-')}", type=int, help=f"the model's {key}")
    ap.add_argument("--json", type=Path, help="write the results here as JSON")
    args = ap.parse_args(argv)
    paths = [p for p in (args.paths or DEFAULT_PATHS[args.method]).split(",") if p]
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        print(f"bench_train: unknown --paths {','.join(unknown)}; e.g. --paths {DEFAULT_PATHS[args.method]}",
              file=sys.stderr)
        return 2
    shape = {**SHAPE, **SHAPES[args.shape],
             **{key: getattr(args, flag) for flag, key in FIELDS.items() if getattr(args, flag) is not None}}
    tokens = args.batch * args.seq
    cpu = cpu_info()
    watch = LoadWatch(int(cpu["cores"]), loadavg)
    watch.sample()
    others = OtherWork(other_sampler or (lambda: other_runnable(os.getpid())))
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp, others:
        tmp_path = Path(tmp)
        batch = write_inputs(tmp_path, args.batch, args.seq, shape)
        why = torch_available(args.torch_python, args.method)
        torch = None if why else Torch(args.torch_python, tmp_path / "model", tmp_path / "batch.npz",
                                       tmp_path / "torch_worker.py", args.method)
        runners = {p: Ours(tmp_path / "model", batch, *PATHS[p]) for p in paths}
        runners["torch"] = torch
        print(f"model: hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, FFN "
              f"{shape['intermediate_size']}, heads {shape['num_attention_heads']} / "
              f"{shape['num_key_value_heads']}, vocab {shape['vocab_size']}, untied; micro-batch {args.batch} x "
              f"{args.seq}; fp32; AdamW" + (f"; LoRA {peft_kwargs()}" if args.method == "lora" else ""))
        print(f"cpu: {cpu['model']}; avx512f {cpu['avx512f']}, avx2 {cpu['avx2']}; {cpu['cores']} cores; "
              f"load average {watch.samples[0]:.2f}")
        print("compiled decoder layers: " + ", ".join(f"{p} {'yes' if runners[p].compiled else 'no'}" for p in paths))
        if torch is None:
            print(f"torch part skipped: {args.torch_python} cannot import torch + transformers"
                  f"{' + peft' if args.method == 'lora' else ''} ({why}); "
                  "pass --torch-python")
        else:
            print(f"torch {torch.info['torch']} + transformers {torch.info['transformers']}"
                  + (f" + peft {torch.info['peft']}" if "peft" in torch.info else "") + " eager, "
                  f"{torch.info['threads']} threads")
        steps: list[tuple[str, float]] = []
        for r, name in interleave(paths, args.rounds + 1):  # round 0 warms up
            if runners[name] is None:
                continue
            s, loss = runners[name].step()
            print(f"  round {r} {name:14s} {s:7.2f} s  loss {loss:.4f}{'  (warm-up)' if r == 0 else ''}"
                  f"  load {watch.sample():.2f}, others {others.mean():.2f}", flush=True)
            if r:
                steps.append((name, s))
        if torch is not None:
            torch.close()
        invalid = others.invalid()
        result = summarize(*by_path(steps), tokens, invalid, args.method)
        for name in paths:
            line = f"{name:14s} {result[name]['tokens_per_s_median']:8.1f} tokens/s (median of {args.rounds})"
            for key, what in (("ratio_to_torch", "peft" if args.method == "lora" else "torch"),
                              ("ratio_to_full", "our full step")):
                ratio = result[name].get(key)
                if ratio:
                    line += (f"; ratio to {what} median {ratio['median']:.2f} "
                             f"(min {ratio['min']:.2f}, max {ratio['max']:.2f})")
            print(line)
        if invalid:
            print(f"{invalid}: no ratio reported; rerun on an idle machine")
        result.update(cpu=cpu, load_samples=watch.samples, other_runnable_mean=others.mean(), rounds=args.rounds,
                      tokens_per_step=tokens, method=args.method, shape=shape,
                      compiled={p: runners[p].compiled for p in paths})
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        if args.breakdown:
            parts = [runners[paths[0]].breakdown() for _ in range(2)][-1]
            print(f"{paths[0]}, one step: " + ", ".join(f"{k} {v:.2f} s" for k, v in parts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
