"""prepare-data speed against the raw tokenizer, on the bundled data repeated to >= 100k samples.

    make bench-data            # or: python tools/bench_data.py [--samples N] [--workers W] [--worker-malloc M]

Writes the samples (each copy made unique, so dedup keeps them) to a temp JSONL file, runs
prepare() end to end (read, clean, template, tokenize in worker processes, labels, cache write,
report) and the raw ``Tokenizer.encode_batch`` (all cores) on the same templated texts (half just
before, half just after, so a busy shared machine affects both alike), and prints both rates and
their ratio (goal >= 0.8).

prepare-data's tokenizer processes run with a faster malloc when one is installed
(``data.worker_malloc``, jobspec/data/malloc.py). The raw encode is then timed twice: in this
process (the system malloc: the tokenizer as a user runs it) and in a child process with the same
malloc preloaded as the workers (the tokenizer at its best here); both ratios are printed.
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

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jobspec.config import ASSETS_DIR
from jobspec.data import malloc
from jobspec.data.encode import load_tokenizer
from jobspec.data.formats import iter_samples
from jobspec.data.prepare import prepare
from jobspec.data.template import render
from jobspec.recipe_load import load_recipe

_CHILD = """
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
texts = json.load(open(sys.argv[2]))
t0 = time.perf_counter()
encs = tok.encode_batch(texts, add_special_tokens=False)
print(time.perf_counter() - t0)
"""


def _raw_preloaded(lib: Path, tok_path: Path, texts_file: Path) -> float:
    """Seconds of the raw batch encode of texts_file in a child process with lib preloaded."""
    with malloc.preloaded(lib):
        out = subprocess.run([sys.executable, "-c", _CHILD, str(tok_path), str(texts_file)],
                             check=True, capture_output=True, text=True).stdout
    return float(out.split()[-1])


def _raw(tok, texts: list[str]) -> tuple[float, int]:
    """Seconds and tokens of the raw batch encode (all cores) of texts."""
    t0 = time.perf_counter()
    encs = tok.encode_batch(texts, add_special_tokens=False)
    return time.perf_counter() - t0, sum(len(e.ids) for e in encs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_data")
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--workers", type=int, default=0, help="data.num_workers (0: all cores)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--worker-malloc", default="auto", help="data.worker_malloc (auto, system or a path)")
    args = ap.parse_args(argv)
    base = [r for f in sorted((ASSETS_DIR / "data").glob("*.json")) for r in json.loads(f.read_text())]
    tok_path = ASSETS_DIR / "tokenizer" / "tokenizer.json"
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        data = Path(tmp) / "bench.jsonl"
        with open(data, "w") as f:
            for i in range(args.samples):
                r = dict(base[i % len(base)])
                r["instruction"] = f"{r['instruction']} (#{i // len(base)})"
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        recipe = load_recipe(raw={"model": {"init": {}}}, overrides={
            "data.paths": [str(data)], "data.num_workers": str(args.workers),
            "data.seq_len": str(args.seq_len), "data.worker_malloc": args.worker_malloc,
            "output_dir": str(Path(tmp) / "out")})
        texts = [render(s, recipe.data.system_prompt) for s in iter_samples(data)]
        tok = load_tokenizer(str(tok_path), tok_path.stat().st_mtime)
        name, lib = malloc.choose(recipe.data.worker_malloc)
        halves = [texts[: len(texts) // 2], texts[len(texts) // 2:]]
        files = [Path(tmp) / f"texts{i}.json" for i in (0, 1)]
        for f, h in zip(files, halves):
            f.write_text(json.dumps(h, ensure_ascii=False))
        load = os.getloadavg()[0]
        t_raw, raw_tokens = _raw(tok, halves[0])  # half before, half after: shared machines drift
        t_pre = _raw_preloaded(lib, tok_path, files[0]) if lib else 0.0
        t0 = time.perf_counter()
        info = prepare(recipe, tok_path, progress=True)
        t_prep = time.perf_counter() - t0
        if lib:
            t_pre += _raw_preloaded(lib, tok_path, files[1])
        t2, n2 = _raw(tok, halves[1])
        t_raw, raw_tokens = t_raw + t2, raw_tokens + n2
        n_read = info.report["samples_read"]
    workers = info.report["tokenizer"]
    if workers["malloc_library"] != (str(lib) if lib else None):  # e.g. --workers 1: no preloaded workers
        lib = None
    prep_sps, raw_sps = n_read / t_prep, len(texts) / t_raw
    print(f"samples: {n_read:,} ({info.num_samples:,} kept, {info.num_tokens:,} tokens cached)")
    print(f"prepare-data end to end:   {t_prep:7.2f} s  {prep_sps:10,.0f} samples/s  "
          f"{info.report['tokens_per_s'] * info.report['elapsed_s'] / t_prep:12,.0f} tokens/s  "
          f"({workers['workers']} tokenizer processes, malloc {workers['malloc']})")
    print(f"raw encode_batch:          {t_raw:7.2f} s  {raw_sps:10,.0f} samples/s  "
          f"{raw_tokens / t_raw:12,.0f} tokens/s  (this process, system malloc)")
    if lib:
        print(f"raw encode_batch, {name + ':':9s}{t_pre:7.2f} s  {len(texts) / t_pre:10,.0f} samples/s  "
              f"{raw_tokens / t_pre:12,.0f} tokens/s  (child process, {lib.name} preloaded)")
    print(f"ratio (samples/s): {prep_sps / raw_sps:.2f} of raw encode_batch (goal >= 0.8)"
          + (f", {t_pre / t_prep:.2f} of raw encode_batch under {name}" if lib else "")
          + f"; {os.cpu_count()} cores, load average {load:.1f} before, {os.getloadavg()[0]:.1f} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
