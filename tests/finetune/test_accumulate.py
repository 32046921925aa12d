"""Issue 30 item 1: gradients accumulate in place, one fp32 accumulator per trained tensor.

Fast: ``accumulate`` over micro-batches gives the out-of-place fp32 sum bit for bit, in the first micro-batch's
own gradient tensors (no new sum per micro-batch), on the DP reduction's path. Slow: through the launcher, the
steps' peak RSS (no checkpoint) of grad_accum 4 exceeds grad_accum 1's (same micro batch) by less than one fp32
copy of the parameters. History on this model (98 % of it embedding and LM head): 8.2 bytes per parameter more
when the previous sum, the micro-batch's gradients, their fp32 copy and the new sum were alive together; 4.55 with
the accumulator alone (one fp32 copy, alive through every later micro-batch's forward and LM head); 2.6 since the
untied embedding's gradient (half the parameters) is summed as its rows, with grad_accum 1 too (parallel/vocab.py
RowGradient): what is left is the LM head's and the layers' accumulator, 2 bytes per parameter of this model.
make bench-memory's difference, over the whole run with its checkpoint, is 0.2 (docs/memory.md).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import weakref

import mindspore as ms
import numpy as np
import pytest
from mindspore import ops

from finetune.dist import RankInfo
from finetune.optim import AdamW
from finetune.parallel.overlap import GradReduction
from finetune.run.loop import accumulate
from jobspec.config import REPO_ROOT, TrainConfig


def _toy():
    rng = np.random.default_rng(0)
    params = [ms.Parameter(ms.Tensor(rng.standard_normal(s).astype(np.float32)), name=f"p{i}")
              for i, s in enumerate([(8, 4), (4,), (4, 3)])]

    def loss(x, y, pos, seg, scale):
        h = ops.tanh(ops.matmul(x, params[0]) + params[1])
        return ops.sum(ops.square(ops.matmul(h, params[2]) - y)) * scale
    return params, ms.value_and_grad(loss, None, params)


def _micro_batches(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"input_ids": rng.standard_normal((5, 8)).astype(np.float32),
             "labels": rng.standard_normal((5, 3)).astype(np.float32),
             "position_ids": np.zeros(1, np.int32), "segment_ids": np.ones(1, np.int32)} for _ in range(n)]


@pytest.mark.parametrize("overlap,compiled", [(False, False), (True, False), (True, True)])
def test_accumulation_is_the_fp32_sum_bit_for_bit_in_the_first_micro_batchs_tensors(monkeypatch, overlap, compiled):
    """Every micro-batch's gradients added in place into the first one's; with compiled layers the overlap's hooks
    sum the last one out of place, one tensor at a time (GradReduction._arrive): the same bits."""
    import finetune.run.loop as train

    monkeypatch.setattr(train, "batch_tensors", lambda mb: [ms.Tensor(mb[k]) for k in
                                                            ("input_ids", "labels", "position_ids", "segment_ids")])
    params, grad_fn = _toy()
    batches, scale = _micro_batches(4), ms.Tensor(0.5, ms.float32)
    parts = [[g.asnumpy().copy() for g in grad_fn(*train.batch_tensors(mb), scale)[1]] for mb in batches]
    ref = [parts[0][i] + parts[1][i] + parts[2][i] + parts[3][i] for i in range(len(params))]  # fp32, in order
    first: list[int] = []

    def recording(*args):
        loss, g = grad_fn(*args)
        if not first:
            first.extend(t.data_ptr() for t in g)
        return loss, g

    opt = AdamW(params, TrainConfig(), RankInfo())
    buckets, loss = accumulate(recording, batches, scale, GradReduction(params, opt, overlap, compiled))
    got = [g for b in buckets for g in b]
    for i, (g, r) in enumerate(zip(got, ref)):
        np.testing.assert_array_equal(g.asnumpy(), r)  # the same additions in the same order: the same bits
        assert (g.data_ptr() != first[i]) if overlap and compiled else (g.data_ptr() == first[i]), f"p{i}"
    assert float(loss.asnumpy()) == pytest.approx(sum(float(grad_fn(*train.batch_tensors(mb), scale)[0].asnumpy())
                                                      for mb in batches), rel=1e-6)


class _Dropping(GradReduction):
    """Records, per gradient it reads, whether dropping it from the list frees it (nothing else holds it)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.freed: list[bool] = []

    def _drop(self, grads: list) -> None:
        for i in range(len(grads)):
            ref, grads[i] = weakref.ref(grads[i]), None
            self.freed.append(ref() is None)

    def add(self, acc, grads):
        self._drop(grads)
        return acc

    def finish(self, grads):
        self._drop(grads)
        return []


def test_accumulate_leaves_each_gradient_to_the_reductions_list_alone(monkeypatch):
    """The reduction drops each gradient as it reads it (``GradReduction.add``, ``finish``): nothing else may
    hold it (before, grad_fn's tuple kept every one of the micro-batch's gradients alive until the reduction
    returned, beside their fp32 casts in bf16/fp16)."""
    import finetune.run.loop as train

    monkeypatch.setattr(train, "batch_tensors", lambda mb: [ms.Tensor(mb[k]) for k in
                                                            ("input_ids", "labels", "position_ids", "segment_ids")])
    params, grad_fn = _toy()
    reduction = _Dropping(params, AdamW(params, TrainConfig(), RankInfo()), False)
    accumulate(grad_fn, _micro_batches(2), ms.Tensor(0.5, ms.float32), reduction)
    assert reduction.freed == [True] * 2 * len(params)


def _peak(tmp, model, grad_accum: int) -> int:
    """Rank 0's peak RSS over 3 steps (no checkpoint before the end: metrics.jsonl's last record)."""
    out = tmp / f"ga{grad_accum}"
    over = ["train.micro_batch_size=1", f"train.grad_accum={grad_accum}", "train.max_steps=3", "train.save_every=0",
            "data.seq_len=256", "data.max_samples=200", "data.val_size=0", "train.warmup_steps=0",
            "train.tensorboard=false", "export.enabled=false"]
    env = {**os.environ, "RECIPE": "tiny-cpu", "OUTPUT_DIR": str(out), "MODEL_DIR": str(model),
           "NPROC_PER_NODE": "1", "OVERRIDES": " ".join(over)}
    subprocess.run([sys.executable, "-m", "launcher", "train"], cwd=REPO_ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return max(json.loads(line)["peak_memory_bytes"] for line in (out / "metrics.jsonl").read_text().splitlines())


@pytest.mark.slow  # two short runs of a 79 M-parameter model through the launcher
def test_grad_accum_4_costs_less_than_a_whole_fp32_accumulator(tmp_path):
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    from bench_memory import shape_of, trained_params
    from bench_train import write_model

    model = tmp_path / "model"
    write_model(model, shape_of(256, 2))  # the real vocabulary: 79 M parameters, 98% of them embedding and head
    for f in (REPO_ROOT / "assets" / "tokenizer").iterdir():
        shutil.copy(f, model / f.name)
    per_param = (_peak(tmp_path, model, 4) - _peak(tmp_path, model, 1)) / trained_params(256, 2)
    assert per_param < 4, f"grad_accum 4 costs {per_param:.2f} bytes per parameter more than grad_accum 1"
