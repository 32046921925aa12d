"""The self-test's collective checks, one msrun worker per device of the node: the collectives the
trainer uses (``finetune.dist``: all-reduce, all-gather, reduce-scatter, and an asynchronous
all-reduce started from a gradient hook, as ``parallel/overlap.py`` does), each compared with the
numpy sum of every rank's data (each rank rebuilds the others' from their seeds).

Run: ``msrun ... <this file> OUT_DIR DEVICE`` (``__main__.collective_rows``); rank r writes
``OUT_DIR/collectives.rank<r>.json`` (its rows); the parent merges them.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from jobspec.layout import Layout
from jobspec.platform import by_target

BUDGET_S = 5.0  # per collective, on an NPU
TOLERANCE = 1e-5  # fp32 sums of a handful of ranks: rounding only
N = {"Ascend": 1 << 20, "CPU": 1 << 10}  # elements per rank


def _data(rank: int, n: int) -> np.ndarray:
    return np.random.default_rng(100 + rank).standard_normal(n).astype(np.float32)


def _err(got, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def main(out_dir: str, device: str) -> int:
    import mindspore as ms

    from finetune import collectives, dist

    world = dist.launched_world()
    rank = dist.init_distributed(Layout(dp=world, device=by_target(device).device))
    group, r, n = rank.world_group, rank.rank, N[device]
    channel = rank.dp_comm.channel([n])  # the DP group is the world here
    total = np.sum([_data(i, n) for i in range(world)], axis=0)
    mine = _data(r, n)
    chunk = n // world
    rows = []

    def timed(name: str, shape: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            err, error = fn(), ""
        except Exception as e:  # a collective that fails is this row's failure
            err, error = None, f"{type(e).__name__}: {e}"[:300]
        rows.append({"name": f"collective_{name}", "shape": shape, "err": err, "seconds": time.perf_counter() - t0,
                     "error": error})

    shape = f"{n} fp32 x {world} ranks"
    timed("all_reduce", shape, lambda: _err(collectives.all_reduce_sum(ms.Tensor(mine), group).asnumpy(), total))
    timed("all_gather", shape, lambda: _err(channel.gather(0, ms.Tensor(mine[:chunk])).asnumpy(),
                                            np.concatenate([_data(i, n)[:chunk] for i in range(world)])))
    timed("reduce_scatter", shape, lambda: _err(channel.reduce_scatter(0, [(ms.Tensor(mine), 0, n)]).wait().asnumpy(),
                                                total[r * chunk:(r + 1) * chunk]))
    timed("async_all_reduce_from_hook", shape, lambda: _hooked(ms, collectives, group, mine, total))
    Path(out_dir, f"collectives.rank{r}.json").write_text(json.dumps(rows))
    return 0


def _hooked(ms, collectives, group, mine: np.ndarray, total: np.ndarray) -> float:
    """The gradient of ``sum(p * mine)`` is ``mine``; its hook starts the async all-reduce of a copy
    (kept referenced until ``wait``) and returns the gradient, as the hook contract asks."""
    from mindspore import ops

    p = ms.Parameter(ms.Tensor(np.zeros_like(mine)), name="selftest_p")
    pending = []

    def hook(grad):
        buf = grad.astype(ms.float32) + 0  # a buffer of our own: the collective writes in place
        pending.append((collectives.all_reduce_sum_async(buf, group), buf))
        return grad

    p.register_hook(hook)
    ms.grad(lambda w: ops.sum(w * ms.Tensor(mine)), grad_position=None, weights=[p])(p)
    if len(pending) != 1:
        raise RuntimeError(f"the gradient hook ran {len(pending)} times, expected once")
    return _err(pending[0][0].wait().asnumpy(), total)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
