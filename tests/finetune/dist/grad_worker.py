"""fp16 micro-batch gradients through the trainer's accumulation and DP reductions; run by msrun.

    grad_worker.py <out_dir>

Each DP rank runs the toy model in fp16 over MICRO micro-batches of its own data, accumulates with
``finetune.run.loop.accumulate`` and reduces with both DP paths (``AdamW``'s all-reduce and
``ShardedAdamW``'s reduce-scatter, 256-byte buckets), each after the backward and overlapped with
the last micro-batch's backward (``GradReduction``). Writes ``rank<r>.npz``: the raw fp16
micro-batch gradients (``raw.<mb>.<i>``), the reduced results (``sum.<i>``, ``shard.<bucket>``;
overlapped: ``overlap-sum.<i>``, ``overlap-shard.<bucket>``; overlapped through Ascend's native
reduce-scatter, here its contract twin: ``native-shard.<bucket>``; the calls of the collective and hook twins:
``calls.<op>``)
and, per overlapped launch, how many gradients the backward had produced (``launched_after.sum``,
``launched_after.shard``).
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mindspore as ms
import numpy as np
from mindspore.communication import get_group_size, get_rank
from mindspore.mint import distributed
from toy_worker import CFG, CLASSES, VOCAB, Toy

from finetune.dist import init_distributed, launched_world
from finetune.optim import AdamW, ShardedAdamW
from finetune.parallel.overlap import GradReduction
from finetune.run.loop import accumulate
from finetune.transport import Native
from jobspec.layout import Layout
from tests.finetune.contracts import twins

MICRO = 8


def fp16_toy() -> tuple[Toy, list]:
    model = Toy()
    params = list(model.trainable_params())
    for p in params:
        p.set_dtype(ms.float16)
    return model, params


def micro_batches(dp_rank: int) -> list[dict[str, np.ndarray]]:
    """MICRO micro-batches of 4 samples in the trainer's batch format (positions/segments unused)."""
    rng = np.random.default_rng(100 + dp_rank)
    out = []
    for _ in range(MICRO):
        x = rng.integers(0, VOCAB, (4, 3)).astype(np.int32)
        out.append({"input_ids": x, "labels": rng.integers(0, CLASSES, (4,)).astype(np.int32),
                    "position_ids": np.zeros_like(x), "segment_ids": np.ones_like(x)})
    return out


def raw_grads(grad_fn, batches: list[dict]) -> list[list[np.ndarray]]:
    """Each micro-batch's raw fp16 gradients."""
    raw = []
    for mb in batches:
        _, g = grad_fn(*(ms.Tensor(mb[k]) for k in ("input_ids", "labels", "position_ids", "segment_ids")),
                       ms.Tensor(1.0, ms.float32))
        raw.append([x.asnumpy() for x in g])
    return raw


def main() -> None:
    out = Path(sys.argv[1])
    rank = init_distributed(Layout(dp=launched_world()))
    model, params = fp16_toy()
    grad_fn = ms.value_and_grad(lambda x, y, pos, seg, scale: model(x, y) * scale, None, params)
    batches = micro_batches(rank.dp_rank)
    result = {f"raw.{m}.{i}": g for m, gs in enumerate(raw_grads(grad_fn, batches)) for i, g in enumerate(gs)}
    ascend = dataclasses.replace(rank, transport=Native(rank.dp, rank.dp_rank, rank.dp_group))
    native = ShardedAdamW(params, CFG, ascend, bucket_bytes=256)  # Ascend's reduce_scatter_tensor: its twin here
    calls: dict[str, int] = {}
    distributed.reduce_scatter_tensor = twins.reduce_scatter_tensor_twin(distributed.all_reduce, get_group_size,
                                                                         get_rank, calls)
    # every asynchronous all-reduce checks its buffer is alive at wait(), every backward hook its return
    distributed.all_reduce = twins.all_reduce_twin(distributed.all_reduce, calls)
    ms.Parameter.register_hook = twins.register_hook_twin(ms.Parameter.register_hook, calls)
    for name, opt, variants in (("sum", AdamW(params, CFG, rank, bucket_bytes=256), (("", False), ("overlap-", True))),
                                ("shard", ShardedAdamW(params, CFG, rank, bucket_bytes=256),
                                 (("", False), ("overlap-", True))),
                                ("shard", native, (("native-", True),))):
        for prefix, overlap in variants:
            reduction = GradReduction(params, opt, overlap)
            buckets, _ = accumulate(grad_fn, batches, ms.Tensor(1.0, ms.float32), reduction)
            got = [g for b in buckets for g in b] if name == "sum" else buckets
            result.update({f"{prefix}{name}.{i}": g.asnumpy() for i, g in enumerate(got)})
            if prefix == "overlap-":
                result[f"launched_after.{name}"] = np.array(reduction.launched_after)
    for op in ("reduce_scatter_tensor", "all_reduce", "register_hook"):
        result[f"calls.{op}"] = np.array(calls.get(op, 0))
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / f"rank{rank.rank}.npz", **result)


if __name__ == "__main__":
    main()
