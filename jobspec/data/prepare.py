"""prepare-data: read, clean, deduplicate, tokenize (worker processes), write the token cache, report.

    python -m jobspec.data.prepare --config plan_or_recipe.json

Memory stays bounded: records stream through chunks, at most 2 chunks per worker in flight,
and arrays are appended to the cache files as they come. :func:`ensure_cache` decides, per node
or per job, which process prepares and lets the others wait.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from jobspec.config import ConfigError, DataConfig, Recipe
from jobspec.cpus import available_cpus
from jobspec.data import cache, malloc
from jobspec.data.clean import RULES
from jobspec.data.encode import ordered_map, start_pool, stop_pool
from jobspec.data.files import DataError, Source, resolve_sources
from jobspec.data.formats import Sample, file_format, is_text, read_samples
from jobspec.data.report import Progress, example, format_report, make_report
from jobspec.data.runcheck import Resumed, check_same_data
from jobspec.data.template import IGNORE
from jobspec.fsutil import ForeignDirectory, atomic_dir
from jobspec.plan_reader import load_plan
from jobspec.rundir import run_dir_of

CHUNK = 256  # samples per worker task
# data.num_workers=0 (auto): below this much input, starting processes costs more than it gains
# (encode_batch is multi-threaded in this process too); above it, one process per core. Measured
# with the preloaded malloc, 2 cores: 7 MB (10k samples) even, 14.5 MB (20k) 2.4 s vs 3.0 s
AUTO_POOL_BYTES = 8 << 20
# data.num_workers=0 (auto) starts at most this many: the reading process feeds about 45k samples/s
# (its share of the CPU, measured: 2.1 s of 9.6 s for 100k samples beside 2 workers at ~5k samples/s
# each), so more workers only add memory and tokenizer loads
MAX_AUTO_WORKERS = 8
VAL_SEED = 20240917  # which samples data.val_size holds out (fixed: the same data gives the same split)


def _chunks(cfg: DataConfig, sources: list[Source], kinds: dict[Path, str], build: _Build,
            ) -> Iterator[tuple[list[Sample], list[int]]]:
    """(samples, copies) chunks, each of one kind (conversations or plain text); a file's weight w
    takes each sample floor(w) times plus an evenly spread deterministic share (w - floor(w)) of
    them once more. Malformed records (data.on_error=skip) go to ``build``."""
    buf: list[Sample] = []
    copies: list[int] = []
    for src in sources:
        whole, frac = int(math.floor(src.weight)), src.weight - math.floor(src.weight)
        kind = kinds[src.path]
        if buf and (kind == "text") != is_text(buf[0]):
            yield buf, copies
            buf, copies = [], []
        samples = read_samples(src.path, kind, columns=cfg.columns, skip=cfg.on_error == "skip")
        for i, s in enumerate(samples):
            build.counts[str(src.path)] = i + 1
            if isinstance(s, DataError):
                build.malformed(s)
                continue
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


def _index_rows(lengths: NDArray[Any], labels: NDArray[Any], offset: int) -> NDArray[Any]:
    """Index rows (start, length, count(labels[1:] != -100), labels[0] != -100) of back-to-back samples."""
    if not len(lengths):
        return np.zeros((0, 4), np.int64)
    ends = np.cumsum(lengths)
    begins = ends - lengths
    is_label = labels != IGNORE
    csum = np.r_[0, np.cumsum(is_label)]
    first = is_label[begins].astype(np.int64)
    return np.stack([offset + begins, lengths, csum[ends] - csum[begins] - first, first], axis=1)


def tokenizer_checked(tokenizer: str | Path) -> Path:
    """The finished recipe's ``model.tokenizer`` (jobspec/finish.py), or ConfigError when it is no file."""
    if tokenizer and Path(tokenizer).is_file():
        return Path(tokenizer)
    raise ConfigError([f"model.tokenizer={str(tokenizer)!r}: no tokenizer.json there; set MODEL_DIR to a Hugging "
                       "Face model directory (config.json, *.safetensors, tokenizer.json)"])


def hold_out(index: NDArray[Any], val_size: float) -> tuple[NDArray[Any], NDArray[Any]]:
    """(train, validation) index rows: val_size (a fraction < 1, or a count) of the unique samples,
    chosen by a fixed seed; a held-out sample leaves training with all its weight copies."""
    starts = np.unique(index[:, 0])
    n = int(round(val_size * len(starts))) if val_size < 1 else int(val_size)
    if not 1 <= n < len(starts):
        raise DataError(f"data.val_size={val_size}: holds out {n} of {len(starts)} samples; choose a size that "
                        f"leaves both sets samples (e.g. data.val_size={max(1, len(starts) // 20)})")
    picked = np.sort(np.random.default_rng(VAL_SEED).choice(starts, n, replace=False))
    is_val = np.isin(index[:, 0], picked)
    val = index[is_val]
    return index[~is_val], val[np.unique(val[:, 0], return_index=True)[1]]


class _Build:
    """The cache being written: token and label streams, index rows, drop counts, dedup keys."""

    def __init__(self, tmp: Path, cfg: DataConfig, progress: bool):
        self.tmp, self.cfg = tmp, cfg
        self.tokens = cache.ArrayStream(tmp / "tokens.npy", np.int32)
        self.labels = cache.ArrayStream(tmp / "labels.npy", np.int32)
        self.parts: dict[str, list[NDArray[Any]]] = {"train": [], "val": []}
        self.dropped: dict[str, dict[str, Any]] = {r: {"count": 0, "examples": []}
                                                   for r in (*RULES, "no_labels", "malformed")}
        self.seen: set[bytes] = set()
        self.counts: dict[str, int] = {}  # records read per source
        self.n_read = self.n_unique = self.n_entries = self.truncated = self.split = self.offset = self.pad_id = 0
        # conversations whose last user/tool turns were dropped
        self.tails: dict[str, Any] = {"count": 0, "examples": []}
        self.bar = Progress(progress)

    def malformed(self, err: DataError) -> None:
        d = self.dropped["malformed"]
        d["count"] += 1
        if len(d["examples"]) < 3:
            d["examples"].append({"error": str(err)[:300]})

    def add(self, samples: list[Sample], copies: list[int], res: dict[str, Any], part: str = "train") -> bool:
        """Write one encoded chunk (after dedup and max_samples); True when max_samples is reached."""
        cfg = self.cfg
        self.n_read += len(samples)
        self.pad_id = res["pad_id"]
        self.truncated += res["truncated"]
        self.split += res["split"]
        reasons = res["reasons"]
        keep_mask = np.ones(len(res["kept"]), dtype=bool)
        if cfg.clean.dedup:
            for j, i in enumerate(res["kept"]):
                key = res["keys"][j]
                if key in self.seen:
                    reasons[i], keep_mask[j] = "dedup", False
                    continue
                self.seen.add(key)
        for i, r in enumerate(reasons):
            if r is not None:
                d = self.dropped[r]
                d["count"] += 1
                if len(d["examples"]) < 3:
                    d["examples"].append(example(samples[i], res["sizes"].get(i)))
        for s in samples:
            if s.dropped_tail:
                self.tails["count"] += 1
                if len(self.tails["examples"]) < 3:
                    self.tails["examples"].append({"where": s.where, "turns_dropped": s.dropped_tail})
        lengths = np.asarray(res["lengths"], dtype=np.int64)
        tok, lab = res["tokens"], res["labels"]
        if not keep_mask.all():
            mask = np.repeat(keep_mask, lengths)
            tok, lab, lengths = tok[mask], lab[mask], lengths[keep_mask]
        kept = list(itertools.compress(res["kept"], keep_mask.tolist()))
        limit = cfg.max_samples if part == "train" else 0
        if limit:
            room = max(limit - self.n_entries, 0)
            reps = np.minimum(np.cumsum([copies[i] for i in kept]), room) if kept else np.zeros(0, int)
            ncopies = np.diff(np.r_[0, reps]).astype(np.int64)
        else:
            ncopies = np.asarray([copies[i] for i in kept], dtype=np.int64)
        self.parts[part].append(np.repeat(_index_rows(lengths, lab, self.offset), ncopies, axis=0))
        self.tokens.write(tok)
        self.labels.write(lab)
        self.offset += int(lengths.sum())
        self.n_unique += len(lengths)
        if part == "train":
            self.n_entries += int(ncopies.sum())
        self.bar.update(self.n_read, self.offset)
        return bool(limit) and self.n_entries >= limit

    def finish(self, sources: list[Source]) -> tuple[NDArray[Any], NDArray[Any]]:
        """Close the streams, write index.npy (and val_index.npy); the train and validation index
        rows (a DataError when nothing was kept)."""
        self.bar.update(self.n_read, self.offset, final=True)
        self.tokens.close()
        self.labels.close()
        index, val = (np.concatenate(p) if p else np.zeros((0, 4), np.int64) for p in self.parts.values())
        if len(index) == 0:
            counts = {k: v["count"] for k, v in self.dropped.items() if v["count"]}
            raise DataError(f"empty data set: all {self.n_read} samples of {', '.join(str(s.path) for s in sources)} "
                            "were dropped; see the drop counts in the report (relax data.clean.* rules or "
                            f"raise data.seq_len): {counts}")
        if self.cfg.val_size:
            index, val = hold_out(index, self.cfg.val_size)
        elif self.cfg.val_paths and not len(val):
            raise DataError(f"data.val_paths: no validation sample left of {self.cfg.val_paths} after the rules "
                            "(a validation sample equal to a training sample is dropped as dedup); see the report")
        np.save(self.tmp / cache.INDEX, index)
        if len(val):
            np.save(self.tmp / cache.VAL_INDEX, val)
        return index, val


def prepare(cfg: DataConfig, out: Path, tokenizer_path: str | Path, progress: bool = True) -> cache.CacheInfo:
    """Build the token cache of ``cfg`` in ``out`` (data.cache_dir); returns what was written."""
    t0 = time.monotonic()
    sources, val_sources = resolve_sources(cfg), resolve_sources(cfg, val=True)
    kinds = {}
    for src in sources + val_sources:  # every file's format (or its error) before any work
        kinds[src.path], why = file_format(src.path, cfg.format, cfg.columns)
        if progress:
            print(f"prepare-data: {src.path}: {kinds[src.path]} ({why})", file=sys.stderr, flush=True)
    size = sum(src.path.stat().st_size for src in sources + val_sources)
    workers = cfg.num_workers or (min(available_cpus(), MAX_AUTO_WORKERS) if size >= AUTO_POOL_BYTES else 1)
    malloc_name, malloc_lib = malloc.choose(cfg.worker_malloc) if workers > 1 else ("system", None)
    args = (str(tokenizer_path), cfg.system_prompt, cfg.seq_len, cfg.clean, cfg.thinking)
    if progress:
        how = (f"{workers} tokenizer processes, malloc {malloc_name}" + (f" ({malloc_lib})" if malloc_lib else
               f" ({malloc.HINT})" if cfg.worker_malloc == "auto" else "")) if workers > 1 else "in this process"
        print(f"prepare-data: {size / 2**20:,.1f} MB in {len(sources) + len(val_sources)} file(s); tokenizing {how}",
              file=sys.stderr, flush=True)
    pool = start_pool(args, workers, malloc_lib)  # workers load the tokenizer while the sources are hashed
    n_read = 0
    try:
        with atomic_dir(out, "token-cache") as tmp:
            manifest: dict[str, Any] = {"settings": cache.settings_of(cfg, tokenizer_path),
                        "sources": [cache.source_entry(s) for s in sources + val_sources]}
            build = _Build(tmp, cfg, progress)
            for part, srcs in (("train", sources), ("val", val_sources)):
                for (samples, copies), res in ordered_map(args, pool, workers, _chunks(cfg, srcs, kinds, build)):
                    if not build.n_read and malloc_lib is not None and res.get("preloaded") != str(malloc_lib):
                        print(f"prepare-data: data.worker_malloc: the tokenizer processes did not load {malloc_lib}; "
                              "they use the system malloc (data.worker_malloc=system says so up front)",
                              file=sys.stderr, flush=True)
                        malloc_name, malloc_lib = "system", None
                    stop = build.add(samples, copies, res, part)
                    n_read = build.n_read
                    if stop:
                        break
            index, val = build.finish(sources)
            report = make_report(cfg, build, index, val, time.monotonic() - t0)
            report["tokenizer"] = {"workers": workers, "malloc": malloc_name,
                                   "malloc_library": str(malloc_lib) if malloc_lib else None}
            report["sources"] = [{"path": str(s.path), "weight": s.weight, "records": build.counts.get(str(s.path), 0),
                                  "format": kinds[s.path], **({"validation": True} if s in val_sources else {})}
                                 for s in sources + val_sources]
            (tmp / "data_report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False))
            manifest.update(num_samples=int(len(index)), num_tokens=build.offset, pad_id=build.pad_id,
                            num_val_samples=int(len(val)), created=time.strftime("%Y-%m-%dT%H:%M:%S"))
            (tmp / cache.MANIFEST).write_text(json.dumps(manifest, indent=2, ensure_ascii=False))
    except BrokenProcessPool:
        raise DataError(f"a tokenizer process died after {n_read:,} samples (killed, e.g. by the out-of-memory "
                        "killer, or crashed); nothing was written. Lower data.num_workers (e.g. data.num_workers=2)"
                        + ("" if malloc_lib is None else f" or set data.worker_malloc=system (it ran {malloc_name})")
                        + " and run prepare-data again") from None
    finally:
        if pool is not None:
            stop_pool(pool)
    return cache.CacheInfo(out, int(len(index)), build.offset, manifest, report, int(len(val)))


def main(recipe: Recipe, table_when_fresh: bool = True) -> int:
    """prepare-data for a finished recipe (jobspec/finish.py): build (or reuse a fresh) cache and print the
    report table; 0 on success."""
    d, out = recipe.data, Path(recipe.data.cache_dir)
    try:
        tok = tokenizer_checked(recipe.model.tokenizer)
        if cache.cache_is_fresh(d, out, cache.settings_of(d, tok)):
            info = cache.load_info(out)
            print(f"prepare-data: cache {info.dir} is up to date ({info.num_samples} samples)")
            if not table_when_fresh:
                return 0
        else:
            check_same_data(d, out, tok, Resumed.of(run_dir_of(recipe), recipe.train.resume))  # before any write
            info = prepare(d, out, tok, progress=True)
        if info.report:
            print(format_report(info.report))
        print(f"prepare-data: cache at {info.dir}")
        return 0
    except (DataError, ConfigError, ForeignDirectory) as e:
        print(f"prepare-data: {e}", file=sys.stderr)
        return 2


def ensure_cache(data: DataConfig, out: Path, tokenizer: str | Path, rank: Any = 0, local_rank: int = 0,
                 timeout_s: float = 3600.0, poll_s: float = 1.0, progress: bool = False,
                 resumed: Resumed | None = None) -> cache.CacheInfo:
    """Make sure a fresh cache of ``data`` exists in ``out`` (data.cache_dir); exactly one process per node (or
    per job) prepares it, refusing to overwrite the data of the checkpoint ``resumed`` continues.

    ``rank`` is the global rank or any object with ``rank`` and ``local_rank`` (e.g. RankInfo).
    The preparer is local rank 0 of each node, or global rank 0 when data.shared_storage; the
    others wait for a fresh manifest and never tokenize on their own.
    """
    if hasattr(rank, "rank"):
        rank, local_rank = rank.rank, rank.local_rank
    tokenizer = tokenizer_checked(tokenizer)
    want = cache.settings_of(data, tokenizer)  # hashes the tokenizer: once, not per poll
    preparer = rank == 0 if data.shared_storage else local_rank == 0
    failed = out.parent / f".{out.name}.failed"
    if preparer:
        if cache.cache_is_fresh(data, out, want):
            return cache.load_info(out)
        failed.unlink(missing_ok=True)
        try:
            check_same_data(data, out, tokenizer, resumed)
            return prepare(data, out, tokenizer, progress=progress)
        except BaseException as e:
            failed.parent.mkdir(parents=True, exist_ok=True)
            failed.write_text(f"{type(e).__name__}: {e}")
            raise
    started, deadline = time.time(), time.monotonic() + timeout_s
    who = "global rank 0" if data.shared_storage else "local rank 0 of this node"
    while not cache.cache_is_fresh(data, out, want):
        if failed.exists() and failed.stat().st_mtime >= started - 1:  # not an old run's marker
            raise RuntimeError(f"rank {rank}: data preparation failed on {who}: {failed.read_text()}")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank {rank}: waited {timeout_s:.0f}s for the token cache {out / cache.MANIFEST} that {who} "
                "prepares; check that rank's log, run `python -m launcher prepare-data` first, or set "
                "data.shared_storage=false when the nodes do not share the output directory")
        time.sleep(poll_s)
    return cache.load_info(out)


def cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jobspec.data.prepare")
    ap.add_argument("--config", required=True, help="plan.json or a resolved recipe (JSON or YAML)")
    args = ap.parse_args(argv)
    try:
        recipe = load_plan(args.config)
    except ConfigError as e:
        print(f"prepare-data: {args.config}: {e}", file=sys.stderr)
        return 2
    return main(recipe)


if __name__ == "__main__":
    sys.exit(cli())
