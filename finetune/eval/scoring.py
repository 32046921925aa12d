"""The model side of an evaluation: log-likelihoods of continuations and greedy generation, as lm-eval's
``hf`` model computes them.

Tokenizing mirrors lm-eval's ``_encode_pair``: the context's trailing whitespace moves to the continuation,
the whole is encoded and the continuation is the tokens after the context's own encoding. Requests are
sorted by length and scored in batches, one forward per batch; requests whose model input is the same
(the choices of a one-token multiple-choice question) share one row. Only the continuations' positions
go through the LM head, each row's once (as many as its longest continuation), and the log-softmax runs over
those rows only.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

Request = tuple[list[int], list[int]]  # (context tokens, continuation tokens)
Progress = Callable[[int, int], None]  # (done, total)


def encode_pair(tok, context: str, continuation: str) -> Request:
    """lm-eval's ``HFLM._encode_pair`` for a causal model without BOS."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False).ids
    ctx = tok.encode(context, add_special_tokens=False).ids
    return ctx, whole[len(ctx):]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def loglikelihoods(model, requests: list[Request], batch_size: int, max_length: int,
                   progress: Progress | None = None) -> list[tuple[float, bool]]:
    """(sum of log-probs of the continuation, whether it is the greedy continuation) per request."""
    import mindspore as ms

    inputs: dict[tuple[int, ...], list[int]] = {}  # model input -> the requests that read it
    for i, (ctx, cont) in enumerate(requests):
        inputs.setdefault(tuple((ctx + cont)[-(max_length + 1):][:-1]), []).append(i)
    order = sorted(inputs, key=lambda x: -len(x))
    out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
    done = 0
    for b in range(0, len(order), batch_size):
        rows = order[b:b + batch_size]
        width = len(rows[0])
        ids = np.zeros((len(rows), width), np.int32)
        for r, x in enumerate(rows):
            ids[r, :len(x)] = x
        hidden = model._hidden(ms.Tensor(ids))  # [b, s, H]; the head runs on the continuations' rows only
        picks: list[int] = []  # each row's last positions once, as many as its longest continuation
        spans: list[tuple[int, int, int]] = []
        for r, x in enumerate(rows):
            longest = max(len(requests[i][1]) for i in inputs[x])
            picks += [r * width + p for p in range(len(x) - longest, len(x))]
            spans += [(i, len(picks) - len(requests[i][1]), len(requests[i][1])) for i in inputs[x]]
        flat = hidden.reshape(-1, hidden.shape[-1])
        logp = _log_softmax(model._project(flat.index_select(0, ms.Tensor(np.array(picks, np.int32)))).asnumpy())
        for i, start, n in spans:
            want = np.array(requests[i][1])
            rows_lp = logp[start:start + n]
            out[i] = (float(rows_lp[np.arange(n), want].sum()), bool((rows_lp.argmax(-1) == want).all()))
            done += 1
        if progress:
            progress(done, len(requests))
    return out


def generate_until(model, tok, contexts: list[str], until: list[str], max_gen_toks: int, max_length: int,
                   stops: set[int], batch_size: int, repetition_penalty: float = 1.0,
                   progress: Progress | None = None) -> list[str]:
    """Greedy answers, each cut at the first of ``until`` (lm-eval's ``generate_until``); batches of
    similar length, left-padded, each row stops at a stop token or once its text holds a stop string."""
    from finetune.generate import Sampling, generate

    enc = [tok.encode(c, add_special_tokens=False).ids[-(max_length - max_gen_toks):] for c in contexts]
    order = sorted(range(len(enc)), key=lambda i: -len(enc[i]))
    greedy = Sampling(temperature=0.0, repetition_penalty=repetition_penalty, max_new_tokens=max_gen_toks)
    out = [""] * len(contexts)

    # a stop string can only have just appeared in the last tokens (lm-eval's MultiTokenEOSCriteria): decoding
    # those, not the whole answer, keeps the check per new token O(1)
    tail = max((len(tok.encode(u, add_special_tokens=False).ids) for u in until), default=0) + 2

    def finished(ids: list[int]) -> bool:
        text = tok.decode(ids[-tail:], skip_special_tokens=True)
        return any(u in text for u in until)

    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        for i, ids in zip(idx, generate(model, [enc[i] for i in idx], stops, greedy, finished=finished)):
            text = tok.decode(ids, skip_special_tokens=True)
            for u in until:
                text = text.split(u)[0]
            out[i] = text
        if progress:
            progress(min(b + batch_size, len(order)), len(order))
    return out


class Meter:
    """The progress line of a task: requests/s and the time left, printed at most every ``every_s``."""

    def __init__(self, label: str, every_s: float = 10.0, log: Callable[[str], None] = print):
        self.label, self.every_s, self.log = label, every_s, log
        self.start = self.last = time.time()

    def __call__(self, done: int, total: int) -> None:
        now = time.time()
        if done < total and now - self.last < self.every_s:
            return
        self.last = now
        rate = done / max(now - self.start, 1e-9)
        eta = (total - done) / rate if rate else 0.0
        self.log(f"[eval] {self.label}: {done}/{total} requests, {rate:.1f} req/s, ETA {eta:.0f} s")
