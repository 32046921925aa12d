"""Data parallelism on one host: DP N (one worker per core) against one process on every core, same global batch.

    make bench-dp                                   # the bench model, DP 2 against one process, 3 rounds
    make bench-dp BENCH_ARGS=--zero                 # DP 2 ZeRO-2 against DP 2 ZeRO-1 (parallel.zero)
    python tools/bench_dp.py --rounds 3 --steps 12 --nproc 2 --json out.json

Each round trains the benchmark model (tools/bench_train.py's shape: hidden 512, 4 layers, vocab 151936,
untied, seeded fp32 weights, the bundled tokenizer) through the launcher as a user would (``python -m launcher
train``, ``RECIPE=tiny-cpu`` on the bundled Alpaca samples, seq_len 256), first as one process with
micro-batch ``--micro-batch x --nproc``, then with ``NPROC_PER_NODE=--nproc`` and micro-batch ``--micro-batch``:
the same rows per step, every default as it is (host collectives, compiled layers, the launcher's CPU
binding, the launcher's malloc settings for CPU workers). tokens/s of a run: the median of metrics.jsonl's
``tokens_per_s`` after the first two steps (compilation, first touch). Prints per round the ratio DP / one, their
median, min and max, the largest loss difference between the two runs (the same training, so ~0), the CPU and
the validity check of tools/bench_train.py (other processes' runnable threads, ``bench_conditions.OtherWork``).
``--zero``: each round runs DP ``--nproc`` twice instead, ``parallel.zero=1`` then ``=2`` (the order alternating
by round, so a load that drifts over the run favours neither), and the ratio is ZeRO-2 / ZeRO-1. Each DP run's
bytes per step that rank 0 sent over DP (metrics.jsonl ``dp_sent_bytes``, counted by the transport) are printed
beside ``jobspec.layout_choice.step_traffic``'s formula for its stage.
A tool, not a test.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # started as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_conditions import OtherWork, cpu_info, other_runnable, read_loadavg
from bench_train import SHAPE, write_model

from jobspec.config import REPO_ROOT
from jobspec.layout_choice import step_traffic
from jobspec.model_layout import local_shapes

WARMUP_STEPS = 2


def run_overrides(steps: int, micro_batch: int, extra: str = "") -> str:
    """The OVERRIDES of one benchmark run: only the step count, the batch and what a measurement needs off."""
    return " ".join([*extra.split(), f"train.max_steps={steps}", f"train.micro_batch_size={micro_batch}",
                     "train.grad_accum=1",
                     "data.seq_len=256", "data.max_samples=400", "data.val_size=0", "train.warmup_steps=0",
                     "train.save_every=0", "train.log_every=1", "train.tensorboard=false", "export.enabled=false"])


def read_run(metrics: Path) -> tuple[float, list[float]]:
    """(median tokens/s after the warm-up steps, the loss of every step) from a run's metrics.jsonl."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "tokens_per_s" in r]
    if len(steps) <= WARMUP_STEPS:
        raise ValueError(f"{metrics}: {len(steps)} step(s) logged, need more than {WARMUP_STEPS}")
    return statistics.median(r["tokens_per_s"] for r in steps[WARMUP_STEPS:]), [r["loss"] for r in steps]


def launch(work: Path, name: str, env: dict[str, str], bench: str) -> Path:
    """``python -m launcher train`` with ``env`` (RECIPE, MODEL_DIR, OVERRIDES, ...) into ``work/name``, its output
    in ``work/name.log``; the run directory. A failed run stops the bench ``bench`` naming the log."""
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    log = work / f"{name}.log"
    with log.open("w") as f:
        rc = subprocess.run([sys.executable, "-m", "launcher", "train"], cwd=REPO_ROOT,
                            env={**env, "OUTPUT_DIR": str(out)}, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:  # the log goes with the temporary directory: its tail here
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise SystemExit(f"{bench}: the {name} run failed (exit {rc}); the end of its output ({log}):\n{tail}")
    return out


def sent_per_step(metrics: Path) -> int | None:
    """The median bytes per step rank 0 sent over DP (differences of metrics.jsonl's ``dp_sent_bytes``), or None."""
    rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if "dp_sent_bytes" in r]
    steps = [b["dp_sent_bytes"] - a["dp_sent_bytes"] for a, b in zip(rows, rows[1:]) if b["step"] == a["step"] + 1]
    return int(statistics.median(steps)) if steps else None


def free_port() -> int:
    """A TCP port nothing listens on now (msrun's scheduler binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def train(work: Path, name: str, model: Path, nproc: int, overrides: str) -> tuple[float, list[float], int | None]:
    """(tokens/s, losses, bytes sent per step) of one run."""
    env = {**os.environ, "RECIPE": "tiny-cpu", "MODEL_DIR": str(model), "NPROC_PER_NODE": str(nproc),
           "OVERRIDES": overrides, "MASTER_PORT": str(free_port())}  # not the default: other jobs may hold it
    metrics = launch(work, name, env, "bench-dp") / "metrics.jsonl"
    return (*read_run(metrics), sent_per_step(metrics))


def traffic(model: Path, nproc: int, sent: dict[str, int | None]) -> str:
    """Each DP run's measured bytes per step beside the formula (fp32, grad_accum 1; ZeRO-1 unless named)."""
    cfg = json.loads((model / "config.json").read_text())
    n = sum(math.prod(s) for s in local_shapes(cfg).values())
    def formula(name: str) -> int:
        stage = int(name[-1]) if name.startswith("zero") else 1
        return step_traffic(stage, weights=n, trained=n, dp=nproc, grad_accum=1, nbytes=4)

    return "; ".join(f"{name} sent {b / 1e6:.1f} MB per step (formula {formula(name) / 1e6:.1f} MB)"
                     for name, b in sent.items() if b)


def summarize(pairs: list[tuple[float, float]]) -> dict[str, float]:
    """Median, min and max over rounds of the measured run's tokens/s / the baseline's (``pairs``: (baseline,
    measured) per round: one process and DP, or ZeRO-1 and ZeRO-2)."""
    ratios = [new / base for base, new in pairs]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "n": len(ratios)}


def contenders(args: argparse.Namespace) -> list[tuple[str, int, str]]:
    """(name, workers, OVERRIDES) of the baseline and the measured run."""
    if args.zero:
        return [(f"zero{z}", args.nproc, run_overrides(args.steps, args.micro_batch, f"parallel.zero={z}"))
                for z in (1, 2)]
    return [("one", 1, run_overrides(args.steps, args.micro_batch * args.nproc)),
            ("dp", args.nproc, run_overrides(args.steps, args.micro_batch))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12, help="steps per run (the first two are not timed)")
    ap.add_argument("--nproc", type=int, default=2, help="DP workers (one per core)")
    ap.add_argument("--micro-batch", type=int, default=2, help="rows per DP worker per step")
    ap.add_argument("--zero", action="store_true", help="DP ZeRO-2 against DP ZeRO-1 instead of DP against one")
    ap.add_argument("--json", type=Path, help="write the results here as JSON")
    args = ap.parse_args(argv)
    cpu = cpu_info()
    print(f"CPU: {cpu['model']} (avx512f {cpu['avx512f']}, avx2 {cpu['avx2']}), {cpu['cores']} cores; "
          f"load average {read_loadavg():.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-dp-") as tmp:
        work, model = Path(tmp), Path(tmp) / "model"
        write_model(model, SHAPE)
        for f in (REPO_ROOT / "assets" / "tokenizer").iterdir():
            shutil.copy(f, model / f.name)
        pairs, loss_diff, sent = [], 0.0, {}
        with OtherWork(lambda: other_runnable(os.getpid())) as others:
            for r in range(args.rounds):
                runs = contenders(args)
                order = runs if not args.zero or r % 2 == 0 else runs[::-1]
                got = {name: train(work, f"{name}-{r}", model, nproc, over) for name, nproc, over in order}
                (base, base_loss, _), (new, new_loss, _) = (got[name] for name, _, _ in runs)
                sent = {name: got[name][2] for name, _, _ in runs}
                loss_diff = max([loss_diff, *(abs(a - b) for a, b in zip(base_loss, new_loss))])
                pairs.append((base, new))
                print(f"round {r}: {runs[0][0]} {base:.1f} tokens/s, {runs[1][0]} {new:.1f} tokens/s: "
                      f"{new / base:.2f}x; load average {read_loadavg():.2f}; {traffic(model, args.nproc, sent)}",
                      flush=True)
    stats = summarize(pairs)
    invalid = others.invalid()
    what = "ZeRO-2 / ZeRO-1" if args.zero else "one process"
    print(f"DP {args.nproc} / {what}: median {stats['median']:.2f}x (min {stats['min']:.2f}, max "
          f"{stats['max']:.2f}) over {len(pairs)} round(s); largest loss difference {loss_diff:.2g}; other "
          f"processes' runnable threads {others.mean():.2f}" + (f"; {invalid}" if invalid else ""))
    if args.json:
        args.json.write_text(json.dumps({"pairs": pairs, "stats": stats, "loss_diff": loss_diff, "cpu": cpu,
                                         "sent": sent, "others": others.mean(), "valid": not invalid}, indent=1))
    return 1 if invalid else 0


if __name__ == "__main__":
    sys.exit(main())
