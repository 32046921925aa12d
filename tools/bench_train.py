"""Training speed: our trainer's step against transformers + torch eager on the same model and batch.

    make bench-train                       # Qwen2 hidden 512, 4 layers, FFN 1408, vocab 151936, untied
    python tools/bench_train.py --steps 4 --torch-python /path/to/venv/bin/python
    python tools/bench_train.py --breakdown   # our step split into forward, backward and optimizer

Both load the same seeded weights (fp32) and train on the same micro-batch (4 x 256 tokens, every
token labelled) with AdamW. The steps are interleaved: ours, then torch's, ``--steps`` times, each
framework in its own process (torch in ``--torch-python``, default this interpreter) so both get
all cores while the other waits. Prints tokens/s of each (median step) and the ratio ours/torch;
without torch + transformers the torch part is skipped with a note. A tool, not a test.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # started as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPE = {"vocab_size": 151936, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 2, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
         "max_position_embeddings": 4096, "tie_word_embeddings": False, "model_type": "qwen2",
         "architectures": ["Qwen2ForCausalLM"]}
LR = 1e-5

TORCH_WORKER = r'''
import json, sys, time
import numpy as np
import torch, transformers

model_dir, batch_file = sys.argv[1], sys.argv[2]
b = np.load(batch_file)
ids, labels = torch.from_numpy(b["ids"].astype(np.int64)), torch.from_numpy(b["labels"].astype(np.int64))
model = transformers.Qwen2ForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=float(sys.argv[3]), weight_decay=0.0)
print(json.dumps({"ready": True, "threads": torch.get_num_threads(), "torch": torch.__version__,
                  "transformers": transformers.__version__}), flush=True)
for line in sys.stdin:
    t = time.perf_counter()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    value = float(loss)
    print(json.dumps({"s": time.perf_counter() - t, "loss": value}), flush=True)
'''


def write_model(path: Path, seed: int = 0) -> None:
    """The benchmark model as a Hugging Face directory with seeded fp32 weights."""
    from safetensors.numpy import save_file

    from jobspec.tiny import random_weights

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**SHAPE, "torch_dtype": "float32"}, indent=1))
    save_file(random_weights(SHAPE, seed), str(path / "model.safetensors"))


def make_batch(batch: int, seq: int, seed: int = 1) -> dict[str, np.ndarray]:
    """One micro-batch of random token ids, every token labelled, one sequence per row."""
    ids = np.random.default_rng(seed).integers(0, SHAPE["vocab_size"], (batch, seq)).astype(np.int32)
    return {"ids": ids, "labels": ids.copy(), "pos": np.tile(np.arange(seq, dtype=np.int32), (batch, 1)),
            "seg": np.ones_like(ids)}


class Ours:
    """Our trainer's step: the model and optimizer as ``finetune.trainer`` builds them (training mode,
    ``train.compile_layers`` from ``--jit-layers``), value_and_grad of the scaled loss (train.accumulate)
    and the AdamW step."""

    def __init__(self, model_dir: Path, batch: dict[str, np.ndarray], jit_layers: bool):
        import mindspore as ms

        from jobspec.config import load_recipe
        from finetune.dist import init_distributed
        from finetune.parallel.overlap import GradReduction
        from finetune.trainer import build_model, build_optimizer

        ms.set_context(mode=ms.PYNATIVE_MODE)
        rank = init_distributed(1, 1, "CPU")  # one process, as finetune.train starts one
        self.ms = ms
        recipe = load_recipe("tiny-cpu", {"model.dir": str(model_dir), "train.lr": LR, "train.weight_decay": 0.0,
                                          "train.clip_grad": 0.0, "train.compile_layers": jit_layers}
                             ).resolved(1, "cpu")
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
        from finetune.train import accumulate

        t = time.perf_counter()
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
    """transformers + torch eager in its own process, one step per request."""

    def __init__(self, python: str, model_dir: Path, batch_file: Path, script: Path):
        script.write_text(TORCH_WORKER)
        self.proc = subprocess.Popen([python, str(script), str(model_dir), str(batch_file), str(LR)],
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


def torch_available(python: str) -> str:
    """'' when ``python`` imports torch and transformers, else why not."""
    r = subprocess.run([python, "-c", "import torch, transformers"], capture_output=True, text=True)
    return "" if r.returncode == 0 else (r.stderr.strip().splitlines() or ["import failed"])[-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_train", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4, help="timed steps of each (after one warm-up step)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--torch-python", default=sys.executable, help="interpreter with torch + transformers")
    ap.add_argument("--jit-layers", action="store_true",
                    help="each decoder layer as one graph (Qwen2Model.compile_layers)")
    ap.add_argument("--breakdown", action="store_true", help="also time our forward, backward and optimizer")
    args = ap.parse_args(argv)
    tokens = args.batch * args.seq
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        tmp_path = Path(tmp)
        write_model(tmp_path / "model")
        batch = make_batch(args.batch, args.seq)
        np.savez(tmp_path / "batch.npz", **batch)
        why = torch_available(args.torch_python)
        torch = None if why else Torch(args.torch_python, tmp_path / "model", tmp_path / "batch.npz",
                                       tmp_path / "torch_worker.py")
        ours = Ours(tmp_path / "model", batch, args.jit_layers)
        print(f"model: hidden {SHAPE['hidden_size']}, {SHAPE['num_hidden_layers']} layers, FFN "
              f"{SHAPE['intermediate_size']}, vocab {SHAPE['vocab_size']}, untied; micro-batch {args.batch} x "
              f"{args.seq}; fp32; AdamW{'; jit on decoder layers' if args.jit_layers else ''}")
        if torch is None:
            print(f"torch part skipped: {args.torch_python} cannot import torch + transformers ({why}); "
                  "pass --torch-python")
        else:
            print(f"torch {torch.info['torch']} + transformers {torch.info['transformers']} eager, "
                  f"{torch.info['threads']} threads")
        times: dict[str, list[float]] = {"ours": [], "torch": []}
        for i in range(args.steps + 1):  # step 0 warms up
            for name, fw in (("ours", ours), ("torch", torch)):
                if fw is None:
                    continue
                s, loss = fw.step()
                print(f"  step {i} {name:5s} {s:7.2f} s  loss {loss:.4f}{'  (warm-up)' if i == 0 else ''}",
                      flush=True)
                if i:
                    times[name].append(s)
        rate = {k: tokens / float(np.median(v)) for k, v in times.items() if v}
        print(f"ours:  {rate['ours']:8.1f} tokens/s (median of {args.steps} steps)")
        if torch is not None:
            torch.close()
            print(f"torch: {rate['torch']:8.1f} tokens/s")
            print(f"ratio ours/torch: {rate['ours'] / rate['torch']:.2f}")
        if args.breakdown:
            parts = [ours.breakdown() for _ in range(2)][-1]
            print("ours, one step: " + ", ".join(f"{k} {v:.2f} s" for k, v in parts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
