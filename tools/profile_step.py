"""Where a training step's time goes, ours against transformers + torch eager at the bench shape.

    make profile-step
    python tools/profile_step.py --torch-python /path/to/venv/bin/python --json out.json

Two tables, each a ratio measured side by side in one run (the absolute ms only to read them):
phase -> ours ms / torch ms / ratio for one step (data to tensors, forward, backward, optimizer; the
host sync of the loss is inside forward) of the ``make bench-train`` model, and the isolated ops of that
shape (LM-head matmul, log-softmax over the vocab, RMSNorm, embedding gradient, AdamW's elementwise
update) in MindSpore and in torch. The machine's load is checked as in bench_train: above the core count
the ratios are flagged NOT VALID. A tool, not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # started as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_conditions import LoadWatch, OtherWork, cpu_info, other_runnable
from bench_train import LR, SHAPE, Ours, torch_available, write_inputs

TORCH_SCRIPT = r'''
import json, sys, time, statistics
import numpy as np
import torch, transformers

model_dir, batch_file, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
b = np.load(batch_file)
model = transformers.Qwen2ForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=float(sys.argv[4]), weight_decay=0.0)
phases = {"data": [], "forward": [], "backward": [], "optimizer": []}
for i in range(reps + 1):
    t0 = time.perf_counter()
    ids, labels = torch.from_numpy(b["ids"].astype(np.int64)), torch.from_numpy(b["labels"].astype(np.int64))
    t1 = time.perf_counter()
    loss = model(input_ids=ids, labels=labels).loss
    float(loss)
    t2 = time.perf_counter()
    loss.backward()
    t3 = time.perf_counter()
    opt.step(); opt.zero_grad(set_to_none=True)
    t4 = time.perf_counter()
    if i:
        for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            phases[k].append(v)
del model, opt
T, H, V = b["ids"].size, int(sys.argv[5]), int(sys.argv[6])
g = torch.Generator().manual_seed(0)
x, w, head = torch.randn(T, H, generator=g), torch.ones(H), torch.randn(H, V, generator=g)
logits, tok = x @ head, torch.from_numpy(b["ids"].reshape(-1).astype(np.int64))
p, m, v = torch.randn(V, H, generator=g), torch.zeros(V, H), torch.zeros(V, H)
def adamw():
    m.mul_(0.9).add_(p, alpha=0.1); v.mul_(0.999).addcmul_(p, p, value=0.001)
    p.sub_(1e-5 * m / (v.sqrt() + 1e-8))
def softmax_grad():
    g = torch.softmax(logits, -1)
    g[torch.arange(T), tok] -= 1.0
    return g
ops = {"matmul": lambda: x @ head, "log_softmax": lambda: torch.log_softmax(logits, -1),
       "softmax_grad_ours": softmax_grad, "adamw_ours": adamw,
       "rmsnorm": lambda: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w,
       "embedding_grad": lambda: torch.zeros(V, H).index_add_(0, tok, x), "adamw": adamw}
out = {}
with torch.no_grad():
    for name, fn in ops.items():
        fn(); ts = []
        for _ in range(reps):
            t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
        out[name] = statistics.median(ts)
print(json.dumps({"phases": {k: statistics.median(v) for k, v in phases.items()}, "ops": out}), flush=True)
'''


def ms_ops(tokens: int, ids: np.ndarray, reps: int) -> dict[str, float]:
    """Median seconds of each isolated op at the bench shape in MindSpore (PyNative, CPU)."""
    import mindspore as ms
    from mindspore import ops

    from finetune.hostmem import own_memory
    from finetune.optim.host import adamw_update_host
    from finetune.parallel.vocab import host_row_sums, host_softmax_minus_onehot

    H, V = SHAPE["hidden_size"], SHAPE["vocab_size"]
    rng = np.random.default_rng(0)
    f32 = lambda a: ms.Tensor(a.astype(np.float32))  # noqa: E731 - a one-line converter
    x, w, head = f32(rng.standard_normal((tokens, H))), f32(np.ones(H)), f32(rng.standard_normal((H, V)))
    logits, tok = ops.matmul(x, head), ms.Tensor(ids.reshape(-1), ms.int32)
    p, m, v = (f32(rng.standard_normal((V, H))), f32(np.zeros((V, H))), f32(np.zeros((V, H))))

    def adamw():
        nonlocal m, v, p
        m = m * 0.9 + p * 0.1
        v = v * 0.999 + p * p * 0.001
        p = p - 1e-5 * m / (ops.sqrt(v) + 1e-8)
        return p

    def adamw_ours():  # the kernel the trainer steps with on CPU (finetune/optim/host.py), the same update
        flat = [own_memory(t).reshape(-1) for t in (p, m, v)]
        adamw_update_host(*flat, flat[0], 1e-5, 0.9, 0.999, 1e-8, 0.0)
        return p

    def softmax_grad_ours():  # the LM head's CPU path: row sums in the forward, softmax - onehot in place
        a = ops.add(logits, 0.0)
        return host_softmax_minus_onehot(a, tok.asnumpy(), host_row_sums(a.asnumpy()))

    table = {"matmul": lambda: ops.matmul(x, head), "log_softmax": lambda: ops.log_softmax(logits, -1),
             "softmax_grad_ours": softmax_grad_ours, "adamw_ours": adamw_ours,
             "rmsnorm": lambda: x * ops.rsqrt((x * x).mean(-1, keep_dims=True) + 1e-6) * w,
             "embedding_grad": lambda: ops.unsorted_segment_sum(x, tok, V), "adamw": adamw}
    out = {}
    for name, fn in table.items():
        fn().asnumpy()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            r = fn()
            r[0].asnumpy()  # waits for the op; copies one row only
            ts.append(time.perf_counter() - t)
        out[name] = statistics.median(ts)
    return out


def ms_phases(ours: Ours, reps: int) -> dict[str, float]:
    """Median seconds of each phase of our step, from Ours.breakdown plus the host->device of the batch."""
    import mindspore as ms

    runs = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        [ms.Tensor(a, ms.int32) for a in ours.mb.values()]
        data = time.perf_counter() - t
        parts = ours.breakdown()
        runs.append({"data": data, "forward": parts["forward"],
                     "backward": parts["forward+backward"] - parts["forward"], "optimizer": parts["optimizer"]})
    return {k: statistics.median(r[k] for r in runs[1:]) for k in runs[0]}


def table(title: str, ours: dict[str, float], ref: dict[str, float] | None) -> list[str]:
    """Rows name | ours ms | torch ms | ratio (ours time / torch time: above 1 we are slower)."""
    lines = [f"{title:16s} {'ours ms':>10s} {'torch ms':>10s} {'ours/torch':>10s}"]
    for k, s in ours.items():
        t = ref.get(k) if ref else None
        cells = f"{t * 1e3:10.2f} {s / t:10.2f}" if t else f"{'-':>10s} {'-':>10s}"
        lines.append(f"{k:16s} {s * 1e3:10.2f} " + cells)
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="profile_step", description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--opbyop", action="store_true",
                    help="our decoder layers op by op (train.compile_layers=false; default: the recipe's, compiled)")
    ap.add_argument("--torch-python", default=sys.executable, help="interpreter with torch + transformers")
    ap.add_argument("--json", type=Path, help="write the results here as JSON")
    args = ap.parse_args(argv)
    cpu = cpu_info()
    watch = LoadWatch(int(cpu["cores"]))
    watch.sample()
    others = OtherWork(lambda: other_runnable(os.getpid()))  # validity: bench_train's check
    with tempfile.TemporaryDirectory(prefix="profile-step-") as tmp, others:
        tmp_path = Path(tmp)
        batch = write_inputs(tmp_path, args.batch, args.seq)
        ref = None
        why = torch_available(args.torch_python)
        if why:
            print(f"torch part skipped: {args.torch_python} cannot import torch + transformers ({why})")
        else:
            script = tmp_path / "torch_profile.py"
            script.write_text(TORCH_SCRIPT)
            r = subprocess.run([args.torch_python, str(script), str(tmp_path / "model"), str(tmp_path / "batch.npz"),
                                str(args.reps), str(LR), str(SHAPE["hidden_size"]), str(SHAPE["vocab_size"])],
                               capture_output=True, text=True, check=True)
            ref = json.loads(r.stdout.strip().splitlines()[-1])
            watch.sample()
        ours = Ours(tmp_path / "model", batch, False if args.opbyop else None)
        phases = ms_phases(ours, args.reps)
        watch.sample()
        del ours
        op_times = ms_ops(args.batch * args.seq, batch["ids"], args.reps)
        watch.sample()
    print(f"cpu: {cpu['model']}; avx512f {cpu['avx512f']}, avx2 {cpu['avx2']}; {cpu['cores']} cores; "
          f"load average samples {', '.join(f'{s:.2f}' for s in watch.samples)}; other processes' runnable "
          f"threads {others.mean():.2f} on average")
    print("\n".join(table("phase", phases, ref and ref["phases"])))
    print("\n".join(table("op", op_times, ref and ref["ops"])))
    if others.invalid():
        print(f"{others.invalid()}: these ratios are not speed claims; rerun on an idle machine")
    if args.json:
        args.json.write_text(json.dumps({"phases": phases, "ops": op_times, "torch": ref, "cpu": cpu,
                                         "load_samples": watch.samples, "other_runnable_mean": others.mean(),
                                         "valid": not others.invalid()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
