"""A toy model trained data-parallel with the sharded optimizer; run by msrun or as one process.

    toy_worker.py <out_dir> <shard: 0|1> [steps] [fallback]

``fallback``: use the AllReduce-based reduce-scatter/all-gather even where native ones exist.

Global batch of 8 samples per step, split over DP ranks; loss = summed per-sample cross-entropy
scaled by 1/global batch (the trainer's 1/global_label_tokens convention), so DP grads SUM.
Writes <out_dir>/rank<r>.json (losses, norms, optimizer state bytes) and rank 0's weights.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from finetune.dist import init_distributed, launched_world
from finetune.optim import ShardedAdamW
from finetune.parallel.grads import global_grad_norm, sum_bucket_over_dp
from finetune.transport import Emulated
from jobspec.config import TrainConfig
from jobspec.layout import Layout

VOCAB, HID, CLASSES, GLOBAL_BATCH = 50, 16, 7, 8
CFG = TrainConfig(lr=5e-2, clip_grad=0.5, weight_decay=0.1)


class Toy(nn.Cell):
    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(0)
        self.emb = ms.Parameter(ms.Tensor(rng.normal(0, 1, (VOCAB, HID)).astype(np.float32)), name="emb")
        self.bias = ms.Parameter(ms.Tensor(rng.normal(0, 0.1, (HID,)).astype(np.float32)), name="bias")
        self.head = ms.Parameter(ms.Tensor(rng.normal(0, 0.3, (HID, CLASSES)).astype(np.float32)), name="head")

    def construct(self, x, y):
        h = ops.tanh(self.emb[x].sum(1) + self.bias)
        logp = ops.log_softmax(ops.matmul(h, self.head), -1)
        return -ops.gather_elements(logp, 1, y[:, None]).sum() / GLOBAL_BATCH


class RefAdamW:
    """Per-tensor torch-AdamW (unsharded reference for the one-process run)."""

    def __init__(self, params):
        self.params, self.t = params, 0
        self.m = [np.zeros(p.shape, np.float32) for p in params]
        self.v = [np.zeros(p.shape, np.float32) for p in params]

    def step(self, grads, lr):
        g = [x.asnumpy() for x in grads]
        norm = float(np.sqrt(sum(float((x.astype(np.float64) ** 2).sum()) for x in g)))
        if norm > CFG.clip_grad:
            g = [x * np.float32(CFG.clip_grad / (norm + 1e-6)) for x in g]
        self.t += 1
        b1, b2 = CFG.betas
        for i, p in enumerate(self.params):
            self.m[i] = b1 * self.m[i] + (1 - b1) * g[i]
            self.v[i] = b2 * self.v[i] + (1 - b2) * g[i] ** 2
            w = p.asnumpy()
            wd = CFG.weight_decay if w.ndim > 1 else 0.0
            denom = np.sqrt(self.v[i] / (1 - b2 ** self.t)) + CFG.eps
            w = w * (1 - lr * wd) - (lr / (1 - b1 ** self.t)) * self.m[i] / denom
            p.set_data(ms.Tensor(w.astype(np.float32)))
        return norm, True

    master: list = []  # fp32 params are their own master


def state_nbytes(opt: ShardedAdamW | RefAdamW) -> int:
    """Bytes of optimizer state held by this rank (moments, plus masters for low-precision params)."""
    return sum(int(t.nbytes) for t in opt.master + opt.m + opt.v)


def main() -> None:
    out, shard = Path(sys.argv[1]), sys.argv[2] == "1"
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    rank = init_distributed(Layout(dp=launched_world()))
    model = Toy()
    params = list(model.trainable_params())
    fallback = len(sys.argv) > 4 and sys.argv[4] == "fallback"
    if fallback:  # the AllReduce emulation of ReduceScatter and AllGather, whatever the backend has
        rank = dataclasses.replace(rank, transport=Emulated(rank.dp, rank.dp_rank, rank.dp_group, None))
    opt = ShardedAdamW(params, CFG, rank, bucket_bytes=256) if shard else RefAdamW(params)  # several buckets
    grad_fn = ms.value_and_grad(model, None, params)
    rng = np.random.default_rng(123)
    losses, norms, gnorms = [], [], []
    per = GLOBAL_BATCH // rank.dp
    for _ in range(steps):
        x = rng.integers(0, VOCAB, (GLOBAL_BATCH, 3)).astype(np.int32)
        y = rng.integers(0, CLASSES, (GLOBAL_BATCH,)).astype(np.int32)
        sl = slice(rank.dp_rank * per, (rank.dp_rank + 1) * per)
        loss, grads = grad_fn(ms.Tensor(x[sl]), ms.Tensor(y[sl]))
        if shard:
            norm = float(opt.step(grads, CFG.lr)[0].asnumpy())
        else:
            grads = sum_bucket_over_dp(list(grads), rank).wait()  # one bucket
            gnorms.append(float(global_grad_norm(grads, params, rank).asnumpy()))
            norm, _ = opt.step(grads, CFG.lr)
        losses.append(float(sum_bucket_over_dp([loss.reshape(1)], rank).wait()[0].asnumpy()[0]))
        norms.append(norm)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank.rank}.json").write_text(json.dumps(
        {"losses": losses, "norms": norms, "gnorms": gnorms, "state_bytes": state_nbytes(opt), "dp": rank.dp,
         "collectives": "allreduce-fallback" if fallback else "default"}))
    np.savez(out / f"weights{rank.rank}.npz", **{p.name: p.asnumpy() for p in params})


if __name__ == "__main__":
    main()
