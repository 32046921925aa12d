"""prepare-data: read, clean, deduplicate, tokenize (worker processes), write the token cache, report.

    python -m finetune.data.prepare --config plan_or_recipe.json

Memory stays bounded: records stream through chunks, at most 2 chunks per worker in flight,
and arrays are appended to the cache files as they come.
"""
from __future__ import annotations

import argparse
import collections
import functools
import itertools
import json
import math
import multiprocessing as mp
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from finetune.config import ASSETS_DIR, CleanConfig, ConfigError, Recipe, load_recipe, resolved_model_dir
from finetune.data import batching, cache, malloc
from finetune.data.clean import RULES, dedup_key, may_repeat, text_rule, token_rule
from finetune.data.formats import DataError, Sample, iter_samples, resolve_sources
from finetune.data.template import (IGNORE, Specials, label_flat, render, render_system, render_turns,
                                    splits_at_specials, truncate)

CHUNK = 256  # samples per worker task
# data.num_workers=0 (auto): below this much input, starting processes costs more than it gains
# (encode_batch is multi-threaded in this process too); above it, one process per core. Measured
# with the preloaded malloc, 2 cores: 7 MB (10k samples) even, 14.5 MB (20k) 2.4 s vs 3.0 s
AUTO_POOL_BYTES = 8 << 20
# data.num_workers=0 (auto) starts at most this many: the reading process feeds about 45k samples/s
# (its share of the CPU, measured: 2.1 s of 9.6 s for 100k samples beside 2 workers at ~5k samples/s
# each), so more workers only add memory and tokenizer loads
MAX_AUTO_WORKERS = 8
# under the system (glibc) malloc, encodings of this many chunks are freed together: freeing each
# chunk's before the next encode makes encode_batch ~1.2-1.4x slower; 48 chunks: ~290 MB RSS per
# worker. Not needed with the preloaded malloc of data.worker_malloc (finetune/data/malloc.py).
HOLD_CHUNKS = 48


@functools.lru_cache(maxsize=2)
def load_tokenizer(path: str, mtime: float):
    """tokenizers.Tokenizer from tokenizer.json (loading takes seconds: reused within a process)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


class Encoder:
    """Text rules, templating, tokenization, labels and truncation for one chunk of samples.

    The system block is encoded once per distinct system prompt and its ids reused: the special
    tokens around it cut the text there, so the ids are those of the whole templated text.
    """

    SYSTEM_CACHE = 4096  # distinct system prompts remembered

    def __init__(self, tokenizer_path: str, system_prompt: str, seq_len: int, clean: CleanConfig):
        self.tok = load_tokenizer(str(tokenizer_path), os.stat(tokenizer_path).st_mtime)
        self.sp = Specials(self.tok)
        self.system_prompt, self.seq_len, self.clean = system_prompt, seq_len, clean
        self.split = splits_at_specials(self.tok)
        self._system_ids: dict[str, list[int]] = {}
        self.hold_chunks = HOLD_CHUNKS  # 0 in a worker with a preloaded malloc
        self._held: list = []  # recent chunks' encodings, see HOLD_CHUNKS

    def _encode(self, samples: list[Sample]) -> list[list[int]]:
        """Token ids of the templated samples."""
        if not self.split:
            encs = self.tok.encode_batch([render(s, self.system_prompt) for s in samples], add_special_tokens=False)
            self._hold(encs)
            return [e.ids for e in encs]
        systems = [render_system(s, self.system_prompt) for s in samples]
        cached = self._system_ids
        new = list(dict.fromkeys(t for t in systems if t not in cached))
        if len(cached) + len(new) > self.SYSTEM_CACHE:
            cached.clear()
            new = list(dict.fromkeys(systems))
        for text, enc in zip(new, self.tok.encode_batch(new, add_special_tokens=False)):
            cached[text] = enc.ids
        encs = self.tok.encode_batch([render_turns(s) for s in samples], add_special_tokens=False)
        self._hold(encs)
        return [cached[t] + e.ids for t, e in zip(systems, encs)]

    def _hold(self, encs: list) -> None:
        if self.hold_chunks:
            self._held.append(encs)
            if len(self._held) >= self.hold_chunks:
                self._held.clear()

    def __call__(self, samples: list[Sample]) -> dict[str, Any]:
        runs = may_repeat(samples, self.clean.repeated_chars_max_run) if self.clean.repeated_chars \
            else [False] * len(samples)
        reasons: list[str | None] = [text_rule(s, self.clean, r) for s, r in zip(samples, runs)]
        todo = [i for i, r in enumerate(reasons) if r is None]
        id_lists = self._encode([samples[i] for i in todo])
        lens = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
        flat = np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int32, count=int(lens.sum()))
        labels = label_flat(flat, self.sp)
        ends = np.cumsum(lens)
        begins = ends - lens
        csum = np.r_[0, np.cumsum(labels != IGNORE)]
        n_lab = csum[ends] - csum[begins]
        # samples that pass the token rules, fit and have labels keep their ids as they are:
        # only the others go through the per-sample Python path
        plain = (lens >= self.clean.min_tokens) & (lens <= self.seq_len) & (n_lab > 0)
        if self.clean.max_tokens:
            plain &= lens <= self.clean.max_tokens
        tok_parts, lab_parts, fixed = [], [], {}
        truncated = 0
        for j in np.flatnonzero(~plain).tolist():
            i, n = todo[j], int(lens[j])
            reason = token_rule(n, self.clean)
            ids, lab = flat[begins[j]:ends[j]], labels[begins[j]:ends[j]]
            if reason is None and n > self.seq_len:
                fit = truncate(ids, lab, self.seq_len, self.sp)
                truncated += fit is not None
                reason = "cannot_fit" if fit is None else None
                ids, lab = fit if fit is not None else (ids, lab)
            if reason is None and not (lab != IGNORE).any():
                reason = "no_labels"
            reasons[i] = reason
            if reason is None:
                fixed[j] = (ids, lab)
        keep_j = plain.copy()
        keep_j[list(fixed)] = True
        kept_j = np.flatnonzero(keep_j).tolist()
        if not fixed:  # the common case: whole samples back to back
            mask = np.repeat(plain, lens)
            tokens, labs = flat[mask], labels[mask]
            lengths = lens[plain].tolist()
        else:
            for j in kept_j:
                ids, lab = fixed.get(j) or (flat[begins[j]:ends[j]], labels[begins[j]:ends[j]])
                tok_parts.append(ids)
                lab_parts.append(lab)
            tokens, labs = np.concatenate(tok_parts), np.concatenate(lab_parts)
            lengths = [len(p) for p in tok_parts]
        kept = [todo[j] for j in kept_j]
        keys = [dedup_key(samples[i]) for i in kept] if self.clean.dedup else [b""] * len(kept)
        return {"reasons": reasons, "kept": kept, "lengths": lengths, "keys": keys,
                "tokens": tokens.astype(np.int32, copy=False), "labels": labs.astype(np.int32, copy=False),
                "truncated": truncated,
                "pad_id": self.sp.pad}


_WORKER: Encoder | None = None
_PRELOADED: str | None = None  # the LD_PRELOAD library this worker really has mapped


def _init_worker(*args: Any) -> None:
    global _WORKER, _PRELOADED
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _WORKER = Encoder(*args)
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    _PRELOADED = next((p for p in os.environ.get("LD_PRELOAD", "").split()
                       if p and os.path.realpath(p) in maps), None)
    _WORKER.hold_chunks = 0 if _PRELOADED else HOLD_CHUNKS  # holding only helps glibc malloc


def _work(samples: list[Sample]) -> dict[str, Any]:
    assert _WORKER is not None
    return {**_WORKER(samples), "preloaded": _PRELOADED}


def available_cpus(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup CPU quota (a Kubernetes
    CPU limit leaves the whole host's CPUs in the mask)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_quota(cgroup)
    return max(1, min(n, math.ceil(quota)) if quota else n)


def _cgroup_quota(cgroup: Path) -> float | None:
    """CPU quota / period of cgroup v2 (cpu.max) or v1 (cpu/cpu.cfs_quota_us); None when unlimited."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()  # "<quota|max> <period>"
    except (OSError, ValueError):
        try:
            quota = (cgroup / "cpu" / "cpu.cfs_quota_us").read_text().strip()  # -1: unlimited
            period = (cgroup / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    try:
        q, p = int(quota), int(period)
    except ValueError:  # "max"
        return None
    return q / p if q > 0 and p > 0 else None


def _chunks(recipe: Recipe, sources: list, counts: dict) -> Iterator[tuple[list[Sample], list[int]]]:
    """(samples, copies) chunks; a file's weight w takes each sample floor(w) times plus an evenly
    spread deterministic share (w - floor(w)) of them once more."""
    buf: list[Sample] = []
    copies: list[int] = []
    for src in sources:
        whole, frac = int(math.floor(src.weight)), src.weight - math.floor(src.weight)
        for i, s in enumerate(iter_samples(src.path, recipe.data.format)):
            counts[str(src.path)] = i + 1
            k = whole + int(math.floor((i + 1) * frac) - math.floor(i * frac))
            if k == 0:
                continue
            buf.append(s)
            copies.append(k)
            if len(buf) == CHUNK:
                yield buf, copies
                buf, copies = [], []
    if buf:
        yield buf, copies


def _start_pool(args: tuple, workers: int, lib: Path | None = None) -> ProcessPoolExecutor | None:
    """``workers`` spawned tokenizer processes, started now with ``lib`` preloaded (None: tokenize in
    this process). A process that dies fails every pending chunk (BrokenProcessPool), never hangs."""
    if workers <= 1:
        return None
    ctx = mp.get_context("spawn")  # the caller may hold threads (tokenizers, mindspore)
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=args)
    with malloc.preloaded(lib):  # processes start on submit: one per task while none is idle
        for _ in range(workers):
            pool.submit(int)
    return pool


def _stop_pool(pool: ProcessPoolExecutor) -> None:
    """Stop the tokenizer processes at once (their pending chunks are not needed)."""
    procs = list(getattr(pool, "_processes", {}).values())  # the executor offers no terminate()
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)


def _ordered_map(args: tuple, pool: ProcessPoolExecutor | None, workers: int,
                 items: Iterator) -> Iterator[tuple[Any, Any]]:
    """(item, encoded item) in order, with at most 2 chunks per worker in flight."""
    if pool is None:
        enc = Encoder(*args)
        for item in items:
            yield item, enc(item[0])
        return
    backlog: collections.deque = collections.deque()
    for item in items:
        backlog.append((item, pool.submit(_work, item[0])))
        if len(backlog) >= 2 * workers:
            it, fut = backlog.popleft()
            yield it, fut.result()
    while backlog:
        it, fut = backlog.popleft()
        yield it, fut.result()


class _Progress:
    def __init__(self, enabled: bool):
        self.enabled, self.t0, self.last = enabled, time.monotonic(), 0.0

    def update(self, n: int, tokens: int, final: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not final and now - self.last < (0.5 if sys.stderr.isatty() else 10)):
            return
        self.last = now
        dt = max(now - self.t0, 1e-9)
        end = "\n" if final or not sys.stderr.isatty() else "\r"
        print(f"prepare-data: {n:,} samples  {tokens:,} tokens  {n / dt:,.0f} samples/s  "
              f"{tokens / dt:,.0f} tokens/s", end=end, file=sys.stderr, flush=True)


def _index_rows(lengths: np.ndarray, labels: np.ndarray, offset: int) -> np.ndarray:
    """Index rows (start, length, count(labels[1:] != -100), labels[0] != -100) of back-to-back samples."""
    if not len(lengths):
        return np.zeros((0, 4), np.int64)
    ends = np.cumsum(lengths)
    begins = ends - lengths
    is_label = labels != IGNORE
    csum = np.r_[0, np.cumsum(is_label)]
    first = is_label[begins].astype(np.int64)
    return np.stack([offset + begins, lengths, csum[ends] - csum[begins] - first, first], axis=1)


def tokenizer_path_for(recipe: Recipe) -> Path:
    """<model dir>/tokenizer.json; the bundled Qwen2.5 tokenizer for the created tiny default."""
    model_dir = resolved_model_dir(recipe)
    if model_dir and (Path(model_dir) / "tokenizer.json").is_file():
        return Path(model_dir) / "tokenizer.json"
    if recipe.model.init is not None:
        return ASSETS_DIR / "tokenizer" / "tokenizer.json"
    raise ConfigError([f"model.dir={model_dir!r}: no tokenizer.json there; set MODEL_DIR to a Hugging Face "
                       "model directory (config.json, *.safetensors, tokenizer.json)"])


def prepare(recipe: Recipe, tokenizer_path: str | Path, progress: bool = True) -> cache.CacheInfo:
    """Build the token cache of recipe.data under cache_dir_for(recipe); returns what was written."""
    t0 = time.monotonic()
    cfg = recipe.data
    sources = resolve_sources(cfg)
    out = cache.cache_dir_for(recipe)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    size = sum(src.path.stat().st_size for src in sources)
    workers = cfg.num_workers or (min(available_cpus(), MAX_AUTO_WORKERS) if size >= AUTO_POOL_BYTES else 1)
    malloc_name, malloc_lib = malloc.choose(cfg.worker_malloc) if workers > 1 else ("system", None)
    args = (str(tokenizer_path), cfg.system_prompt, cfg.seq_len, cfg.clean)
    if progress:
        how = (f"{workers} tokenizer processes, malloc {malloc_name}" + (f" ({malloc_lib})" if malloc_lib else
               f" ({malloc.HINT})" if cfg.worker_malloc == "auto" else "")) if workers > 1 else "in this process"
        print(f"prepare-data: {size / 2**20:,.1f} MB in {len(sources)} file(s); tokenizing {how}",
              file=sys.stderr, flush=True)
    pool = _start_pool(args, workers, malloc_lib)  # workers load the tokenizer while the sources are hashed
    pad_id = 0
    index_parts: list[np.ndarray] = []
    dropped = {r: {"count": 0, "examples": []} for r in (*RULES, "no_labels")}
    seen: set[bytes] = set()
    counts: dict[str, int] = {}
    n_read = n_unique = n_entries = truncated = offset = 0
    bar = _Progress(progress)
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        manifest = {"settings": cache.settings_of(recipe, tokenizer_path),
                    "sources": [cache.source_entry(s) for s in sources]}
        tokens = cache.ArrayStream(tmp / "tokens.npy", np.int32)
        labels = cache.ArrayStream(tmp / "labels.npy", np.int32)
        for (samples, copies), res in _ordered_map(args, pool, workers, _chunks(recipe, sources, counts)):
            n_read += len(samples)
            pad_id = res["pad_id"]
            if n_read == len(samples) and malloc_lib is not None and res.get("preloaded") != str(malloc_lib):
                print(f"prepare-data: data.worker_malloc: the tokenizer processes did not load {malloc_lib}; "
                      "they use the system malloc (data.worker_malloc=system says so up front)",
                      file=sys.stderr, flush=True)
                malloc_name, malloc_lib = "system", None
            truncated += res["truncated"]
            reasons = res["reasons"]
            keep_mask = np.ones(len(res["kept"]), dtype=bool)
            for j, i in enumerate(res["kept"]):
                key = res["keys"][j]
                if cfg.clean.dedup:
                    if key in seen:
                        reasons[i], keep_mask[j] = "dedup", False
                        continue
                    seen.add(key)
            for i, r in enumerate(reasons):
                if r is not None:
                    d = dropped[r]
                    d["count"] += 1
                    if len(d["examples"]) < 3:
                        d["examples"].append(_example(samples[i]))
            lengths = np.asarray(res["lengths"], dtype=np.int64)
            tok, lab = res["tokens"], res["labels"]
            if not keep_mask.all():
                mask = np.repeat(keep_mask, lengths)
                tok, lab, lengths = tok[mask], lab[mask], lengths[keep_mask]
            kept = list(itertools.compress(res["kept"], keep_mask.tolist()))
            if cfg.max_samples:
                room = max(cfg.max_samples - n_entries, 0)
                reps = np.minimum(np.cumsum([copies[i] for i in kept]), room) if kept else np.zeros(0, int)
                ncopies = np.diff(np.r_[0, reps]).astype(np.int64)
            else:
                ncopies = np.asarray([copies[i] for i in kept], dtype=np.int64)
            index_parts.append(np.repeat(_index_rows(lengths, lab, offset), ncopies, axis=0))
            tokens.write(tok)
            labels.write(lab)
            offset += int(lengths.sum())
            n_unique += len(lengths)
            n_entries += int(ncopies.sum())
            bar.update(n_read, offset)
            if cfg.max_samples and n_entries >= cfg.max_samples:
                break
        bar.update(n_read, offset, final=True)
        tokens.close()
        labels.close()
        index = np.concatenate(index_parts) if index_parts else np.zeros((0, 4), np.int64)
        if len(index) == 0:
            raise DataError(f"empty data set: all {n_read} samples of {', '.join(str(s.path) for s in sources)} "
                            "were dropped; see the drop counts in the report (relax data.clean.* rules or "
                            f"raise data.seq_len): { {k: v['count'] for k, v in dropped.items() if v['count']} }")
        np.save(tmp / "index.npy", index)
        elapsed = time.monotonic() - t0
        report = make_report(recipe, index[:, 1], n_read, n_unique, dropped, truncated, elapsed, offset)
        report["tokenizer"] = {"workers": workers, "malloc": malloc_name,
                               "malloc_library": str(malloc_lib) if malloc_lib else None}
        report["sources"] = [{"path": str(s.path), "weight": s.weight, "records": counts.get(str(s.path), 0)}
                             for s in sources]
        (tmp / "data_report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False))
        manifest.update(num_samples=int(len(index)), num_tokens=offset, pad_id=pad_id,
                        created=time.strftime("%Y-%m-%dT%H:%M:%S"))
        (tmp / cache.MANIFEST).write_text(json.dumps(manifest, indent=2, ensure_ascii=False))
        cache.publish(tmp, out)
    except BrokenProcessPool:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(f"a tokenizer process died after {n_read:,} samples (killed, e.g. by the out-of-memory "
                        "killer, or crashed); nothing was written. Lower data.num_workers (e.g. data.num_workers=2)"
                        + ("" if malloc_lib is None else f" or set data.worker_malloc=system (it ran {malloc_name})")
                        + " and run prepare-data again") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if pool is not None:
            _stop_pool(pool)
    return cache.CacheInfo(out, int(len(index)), offset, manifest, report)


def _example(s: Sample) -> dict:
    answer = next((c for r, c in reversed(s.turns) if r == "assistant"), "")
    prompt = next((c for r, c in reversed(s.turns) if r == "user"), "")
    return {"where": s.where, "prompt": prompt[:120], "response": answer[:120]}


def make_report(recipe: Recipe, lengths: np.ndarray, n_read: int, n_unique: int, dropped: dict,
                truncated: int, elapsed: float, n_tokens: int) -> dict:
    """data_report.json content: counts per rule, length percentiles, batching efficiency."""
    cfg = recipe.data
    pct = {f"p{q}": int(np.percentile(lengths, q)) for q in (50, 90, 95, 99)} if len(lengths) else {}
    eff: dict[str, Any] = {"seq_len": cfg.seq_len}
    if len(lengths):
        rows = batching.pack_ffd(lengths, cfg.seq_len)
        eff["packed_rows"] = len(rows)
        eff["packing"] = round(float(lengths.sum()) / (len(rows) * cfg.seq_len), 4)
        eff["padding"] = round(float(lengths.mean()) / cfg.seq_len, 4)
        if cfg.max_tokens_per_batch:
            groups = batching.group_by_budget(lengths, cfg.max_tokens_per_batch)
            eff["dynamic"] = round(batching.efficiency(groups, lengths), 4)
            eff["dynamic_batches"] = len(groups)
    return {"samples_read": n_read, "samples_kept": n_unique, "index_entries": int(len(lengths)),
            "tokens": n_tokens, "truncated": truncated,
            "dropped": {k: v for k, v in dropped.items() if v["count"]},
            "token_length": {"mean": round(float(lengths.mean()), 1) if len(lengths) else 0, **pct,
                             "max": int(lengths.max()) if len(lengths) else 0},
            "efficiency": eff, "elapsed_s": round(elapsed, 2),
            "samples_per_s": round(n_read / max(elapsed, 1e-9), 1),
            "tokens_per_s": round(n_tokens / max(elapsed, 1e-9), 1)}


def format_report(report: dict) -> str:
    """The console table."""
    lines = [f"{'rule':<16}{'dropped':>9}  example",
             "-" * 72]
    for rule, d in report.get("dropped", {}).items():
        ex = d["examples"][0] if d["examples"] else {}
        lines.append(f"{rule:<16}{d['count']:>9}  {ex.get('where', '')}")
    lines += ["-" * 72,
              f"{'kept':<16}{report['samples_kept']:>9}  of {report['samples_read']} read; "
              f"{report['index_entries']} after weights, {report['truncated']} truncated, {report['tokens']:,} tokens"]
    tl = report["token_length"]
    lines.append("tokens/sample   " + "  ".join(f"{k} {v}" for k, v in tl.items()))
    eff = report["efficiency"]
    lines.append("efficiency      " + "  ".join(f"{k} {v}" for k, v in eff.items()))
    lines.append(f"speed           {report['samples_per_s']:,} samples/s  {report['tokens_per_s']:,} tokens/s "
                 f"({report['elapsed_s']} s)")
    return "\n".join(lines)


def main(recipe: Recipe) -> int:
    """prepare-data: build (or reuse a fresh) cache and print the report table; 0 on success."""
    try:
        tok = tokenizer_path_for(recipe)
        if cache.cache_is_fresh(recipe, tok):
            info = cache.load_info(cache.cache_dir_for(recipe))
            print(f"prepare-data: cache {info.dir} is up to date ({info.num_samples} samples)")
        else:
            info = prepare(recipe, tok, progress=True)
        if info.report:
            print(format_report(info.report))
        print(f"prepare-data: cache at {info.dir}")
        return 0
    except (DataError, ConfigError) as e:
        print(f"prepare-data: {e}", file=sys.stderr)
        return 2


def cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m finetune.data.prepare")
    ap.add_argument("--config", required=True, help="plan.json or a resolved recipe (JSON or YAML)")
    args = ap.parse_args(argv)
    try:
        path = Path(args.config)
        if path.suffix in (".yaml", ".yml"):
            recipe = load_recipe(str(path))
        else:
            raw = json.loads(path.read_text())
            recipe = load_recipe(raw=raw.get("recipe", raw))
    except (ConfigError, OSError, json.JSONDecodeError) as e:
        print(f"prepare-data: {args.config}: {e}", file=sys.stderr)
        return 2
    return main(recipe)


if __name__ == "__main__":
    sys.exit(cli())
