"""Tokenizing chunks of samples: text rules, template, token ids, labels, truncation; the worker pool.

The encoder runs in this process or in spawned tokenizer processes (``data.num_workers``), each
with the malloc of ``data.worker_malloc`` preloaded.
"""
from __future__ import annotations

import collections
import functools
import itertools
import multiprocessing as mp
import os
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from jobspec.config import CleanConfig
from jobspec.data import malloc
from jobspec.data.clean import dedup_key, may_repeat, text_rule, token_rule
from jobspec.data.formats import Sample, is_text, uses_tools
from jobspec.data.template import (
    IGNORE,
    Specials,
    chat_format,
    label_flat,
    render,
    render_system,
    render_turns,
    splits_at_specials,
    truncate,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# under the system (glibc) malloc, encodings of this many chunks are freed together: freeing each
# chunk's before the next encode makes encode_batch ~1.2-1.4x slower; 48 chunks: ~290 MB RSS per
# worker. Not needed with the preloaded malloc of data.worker_malloc (jobspec/data/malloc.py).
HOLD_CHUNKS = 48


@functools.lru_cache(maxsize=2)
def load_tokenizer(path: str, mtime: float) -> Tokenizer:
    """tokenizers.Tokenizer from tokenizer.json (loading takes seconds: reused within a process)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


class Encoder:
    """Text rules, templating, tokenization, labels and truncation for one chunk of samples.

    The system block is encoded once per distinct system prompt and its ids reused: the special
    tokens around it cut the text there, so the ids are those of the whole templated text.
    """

    SYSTEM_CACHE = 4096  # distinct system prompts remembered

    def __init__(self, tokenizer_path: str, system_prompt: str, seq_len: int, clean: CleanConfig,
                 thinking: str = "auto"):
        self.tok = load_tokenizer(str(tokenizer_path), os.stat(tokenizer_path).st_mtime)
        self.sp = Specials(self.tok)
        self.fmt, self.thinking = chat_format(tokenizer_path), thinking  # the model family's template
        self.system_prompt, self.seq_len, self.clean = system_prompt, seq_len, clean
        self.split = splits_at_specials(self.tok)
        self._system_ids: dict[str, list[int]] = {}
        self.hold_chunks = HOLD_CHUNKS  # 0 in a worker with a preloaded malloc
        self._held: list[Any] = []  # recent chunks' encodings, see HOLD_CHUNKS

    def _encode(self, samples: list[Sample]) -> list[list[int]]:
        """Token ids of the templated samples."""
        if not self.split:
            texts = [render(s, self.system_prompt, self.fmt, self.thinking) for s in samples]
            encs = self.tok.encode_batch(texts, add_special_tokens=False)
            self._hold(encs)
            return [e.ids for e in encs]
        systems = [render_system(s, self.system_prompt, self.fmt) for s in samples]
        cached = self._system_ids
        new = list(dict.fromkeys(t for t in systems if t not in cached))
        if len(cached) + len(new) > self.SYSTEM_CACHE:
            cached.clear()
            new = list(dict.fromkeys(systems))
        for text, enc in zip(new, self.tok.encode_batch(new, add_special_tokens=False)):
            cached[text] = enc.ids
        encs = self.tok.encode_batch([render_turns(s, self.fmt, self.thinking) for s in samples],
                                     add_special_tokens=False)
        self._hold(encs)
        return [cached[t] + e.ids for t, e in zip(systems, encs)]

    def _hold(self, encs: list[Any]) -> None:
        if self.hold_chunks:
            self._held.append(encs)
            if len(self._held) >= self.hold_chunks:
                self._held.clear()

    def __call__(self, samples: list[Sample]) -> dict[str, Any]:
        """Encode one chunk (all conversations or all plain-text documents): per sample the drop
        reason or None, and the kept entries' tokens and labels back to back."""
        if samples and is_text(samples[0]):
            return self._documents(samples)
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
        sizes = {}  # tokens of the samples dropped after tokenizing
        for j in np.flatnonzero(~plain).tolist():
            i, n = todo[j], int(lens[j])
            reason = token_rule(n, self.clean)
            ids, lab = flat[begins[j]:ends[j]], labels[begins[j]:ends[j]]
            if reason is None and n > self.seq_len:
                # cutting a tool conversation would separate calls from their schemas and results
                fit = None if uses_tools(samples[i]) else truncate(ids, lab, self.seq_len, self.sp)
                truncated += fit is not None
                reason = "cannot_fit" if fit is None else None
                ids, lab = fit if fit is not None else (ids, lab)
            if reason is None and not (lab != IGNORE).any():
                reason = "no_labels"
            reasons[i] = reason
            if reason is None:
                fixed[j] = (ids, lab)
            else:
                sizes[i] = n
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
                "truncated": truncated, "split": 0, "sizes": sizes, "pad_id": self.sp.pad}

    def _documents(self, samples: list[Sample]) -> dict[str, Any]:
        """Plain-text documents: each ends with <|endoftext|>, every token is a label, and a document
        longer than seq_len becomes seq_len pieces (the last piece as long as what remains)."""
        reasons: list[str | None] = [text_rule(s, self.clean) for s in samples]
        todo = [i for i, r in enumerate(reasons) if r is None]
        encs = self.tok.encode_batch([samples[i].turns[0][1] for i in todo], add_special_tokens=False)
        kept, parts, keys, sizes, split = [], [], [], {}, 0
        for i, e in zip(todo, encs):
            ids = e.ids + [self.sp.pad]
            reasons[i] = token_rule(len(ids), self.clean)
            if reasons[i] is not None:
                sizes[i] = len(ids)
                continue
            key = dedup_key(samples[i]) if self.clean.dedup else b""
            pieces = [ids[k:k + self.seq_len] for k in range(0, len(ids), self.seq_len)]
            pieces = [p for p in pieces if len(p) > 1] or pieces[:1]  # one token: nothing to predict
            split += len(pieces) > 1
            for k, piece in enumerate(pieces):
                kept.append(i)
                parts.append(piece)
                keys.append(key + k.to_bytes(4, "little") if k else key)  # pieces are not duplicates
        tokens = np.fromiter(itertools.chain.from_iterable(parts), dtype=np.int32)
        return {"reasons": reasons, "kept": kept, "lengths": [len(p) for p in parts], "keys": keys,
                "tokens": tokens, "labels": tokens.copy(), "truncated": 0, "split": split, "sizes": sizes,
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


def start_pool(args: tuple[Any, ...], workers: int, lib: Path | None = None) -> ProcessPoolExecutor | None:
    """``workers`` spawned tokenizer processes, started now with ``lib`` preloaded (None: tokenize in
    this process). A process that dies fails the chunks waited on (BrokenProcessPool, :func:`pool_result`)."""
    if workers <= 1:
        return None
    ctx = mp.get_context("spawn")  # the caller may hold threads (tokenizers, mindspore)
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=args)
    with malloc.preloaded(lib):  # processes start on submit: one per task while none is idle
        for _ in range(workers):
            pool.submit(int)
    return pool


def _processes(pool: ProcessPoolExecutor) -> list[Any]:
    """The pool's processes (the executor exposes them no other way)."""
    return list((getattr(pool, "_processes", None) or {}).values())


def stop_pool(pool: ProcessPoolExecutor) -> None:
    """Stop the tokenizer processes at once (their pending chunks are not needed).

    A process killed while it sends a result leaves half a message in the result pipe; CPython
    3.11's executor thread then waits in ``recv`` for the rest forever, and the interpreter joins
    that thread at exit, so the process never ends. This process never writes results, so it closes
    its end for writing: once the processes are gone it was the last one, the read ends (EOF) and
    the thread winds the pool down.
    """
    procs = _processes(pool)  # the executor offers no terminate()
    writer = getattr(getattr(pool, "_result_queue", None), "_writer", None)  # shutdown drops the queue
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
    if writer is not None:
        writer.close()


def pool_result(pool: ProcessPoolExecutor, fut: Future[Any], poll_s: float = 1.0) -> Any:
    """``fut``'s result; BrokenProcessPool as soon as a tokenizer process has exited. The executor
    alone can lose a future: on CPython 3.11 ``terminate_broken`` fails the pending futures without
    the lock ``submit`` holds, so a chunk submitted in that instant is never failed and its
    ``result()`` waits forever."""
    while True:
        try:
            return fut.result(timeout=poll_s)
        except TimeoutError:
            if any(p.exitcode is not None for p in _processes(pool)):
                raise BrokenProcessPool("a tokenizer process exited") from None


def ordered_map(args: tuple[Any, ...], pool: ProcessPoolExecutor | None, workers: int,
                 items: Iterator[Any]) -> Iterator[tuple[Any, Any]]:
    """(item, encoded item) in order, with at most 2 chunks per worker in flight."""
    if pool is None:
        enc = Encoder(*args)
        for item in items:
            yield item, enc(item[0])
        return
    backlog: collections.deque[Any] = collections.deque()
    for item in items:
        backlog.append((item, pool.submit(_work, item[0])))
        if len(backlog) >= 2 * workers:
            it, fut = backlog.popleft()
            yield it, pool_result(pool, fut)
    while backlog:
        it, fut = backlog.popleft()
        yield it, pool_result(pool, fut)
