"""fp16 micro-batch gradients through the trainer's accumulation and DP reductions; run by msrun.

    grad_worker.py <out_dir>

Each DP rank runs the toy model in fp16 over MICRO micro-batches of its own data, accumulates with
``finetune.train.accumulate`` and reduces with both DP paths (``sum_grads_over_dp`` and
``ShardedAdamW.reduce``). Writes ``rank<r>.npz``: the raw fp16 micro-batch gradients (``raw.<mb>.<i>``)
and both reduced results (``sum.<i>``, ``shard.<bucket>``).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mindspore as ms  # noqa: E402
import numpy as np  # noqa: E402

from finetune.dist import init_distributed, launched_world  # noqa: E402
from finetune.parallel.grads import sum_grads_over_dp  # noqa: E402
from finetune.parallel.zero import ShardedAdamW  # noqa: E402
from finetune.train import accumulate  # noqa: E402
from toy_worker import CFG, CLASSES, VOCAB, Toy  # noqa: E402

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


def grads_of(model: Toy, params: list, batches: list[dict]) -> tuple[list, list[list[np.ndarray]]]:
    """(accumulated fp32 gradients, each micro-batch's raw fp16 gradients)."""
    grad_fn = ms.value_and_grad(lambda x, y, pos, seg, scale: model(x, y) * scale, None, params)
    raw = []
    for mb in batches:
        _, g = grad_fn(*(ms.Tensor(mb[k]) for k in ("input_ids", "labels", "position_ids", "segment_ids")),
                       ms.Tensor(1.0, ms.float32))
        raw.append([x.asnumpy() for x in g])
    acc, _ = accumulate(grad_fn, batches, ms.Tensor(1.0, ms.float32))
    return acc, raw


def main() -> None:
    out = Path(sys.argv[1])
    rank = init_distributed(tp=1, dp=launched_world(), device_target="CPU")
    model, params = fp16_toy()
    acc, raw = grads_of(model, params, micro_batches(rank.dp_rank))
    sharded = ShardedAdamW(params, CFG, rank, bucket_bytes=256)
    result = {f"raw.{m}.{i}": g for m, gs in enumerate(raw) for i, g in enumerate(gs)}
    result.update({f"sum.{i}": g.asnumpy() for i, g in enumerate(sum_grads_over_dp(acc, rank))})
    result.update({f"shard.{k}": g.asnumpy() for k, g in enumerate(sharded.reduce(acc))})
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / f"rank{rank.rank}.npz", **result)


if __name__ == "__main__":
    main()
