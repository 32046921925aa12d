"""Contract twins for the tests: the fused-kernel twins (``finetune.selftest.twins``, which the self-test
runs on CPU) plus the optimizer kernel's and the sharded optimizer's reduce-scatter twins.

Sources beyond those of ``finetune.selftest.twins``:

- ``MS-ADAMWD``: MindSpore 2.10 ``ops.AdamWeightDecay`` docstring and ``__mindspore_signature__``
  (``mindspore/ops/auto_generate/gen_ops_prim.py``).
- ``MS-COMM``: MindSpore 2.10 ``mint.distributed.reduce_scatter_tensor`` docstring
  (``mindspore/mint/distributed/distributed.py``): the native reduce-scatter of the sharded
  optimizer's gradient buckets on Ascend (the CPU backend has no ReduceScatter kernel).

``install(monkeypatch.setattr)`` puts every twin in place; the model's fused path
(``RankInfo(device_target="Ascend")``) then runs on CPU.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import Tensor, ops

from finetune.selftest.twins import CONTRACTS as FUSED_CONTRACTS
from finetune.selftest.twins import (ContractError, Rule, flash_attention_score, install_fused,  # noqa: F401
                                     rms_norm, rotary_position_embedding, swiglu)
from finetune.selftest.twins import need as _need

CONTRACTS: dict[tuple[str, str], Rule] = {
    **FUSED_CONTRACTS,
    # AdamWeightDecay
    ("AdamWeightDecay", "dtype"): Rule("var, m, v are float16 or float32; m and v share a dtype; gradient has "
                                       "var's dtype (signature groups T, T1)", "MS-ADAMWD Inputs, signature"),
    ("AdamWeightDecay", "shape"): Rule("m, v and gradient have var's shape", "MS-ADAMWD Inputs"),
    ("AdamWeightDecay", "scalars"): Rule("lr, beta1, beta2, epsilon, decay are float32 scalars; epsilon > 0, "
                                         "beta1/beta2 in (0, 1), decay >= 0", "MS-ADAMWD Inputs, Raises"),
    # mint.distributed.reduce_scatter_tensor
    ("reduce_scatter_tensor", "args"): Rule("output and input are Tensors of the same dtype; op is one of sum, "
                                            "prod, min, max, avg; group is a str; async_op is a bool",
                                            "MS-COMM Args output/input/op/group/async_op, Raises TypeError"),
    ("reduce_scatter_tensor", "shape"): Rule("input is (N, *) with N divisible by the group size; output is "
                                             "(N / group size, *)", "MS-COMM Args output/input"),
}


def need(op: str, key: str, ok: bool, got: str) -> None:
    _need(op, key, ok, got, CONTRACTS)


def adam_weight_decay_twin(real_cls, calls: dict[str, int]):
    """A class standing in for ``ops.AdamWeightDecay``: checks each call, then runs the real CPU kernel."""

    class AdamWeightDecay:
        def __init__(self, use_locking=False):
            self.real = real_cls(use_locking)

        def __call__(self, var, m, v, lr, beta1, beta2, epsilon, decay, gradient):
            op = "AdamWeightDecay"
            calls[op] = calls.get(op, 0) + 1
            f16_32 = (ms.float16, ms.float32)
            need(op, "dtype", var.dtype in f16_32 and m.dtype in f16_32 and v.dtype == m.dtype
                 and gradient.dtype == var.dtype, f"var {var.dtype}, m {m.dtype}, v {v.dtype}, grad {gradient.dtype}")
            need(op, "shape", m.shape == var.shape and v.shape == var.shape and gradient.shape == var.shape,
                 f"var {var.shape}, m {m.shape}, v {v.shape}, grad {gradient.shape}")
            scalars = (lr, beta1, beta2, epsilon, decay)
            need(op, "scalars", all(isinstance(s, Tensor) and s.dtype == ms.float32 and s.ndim == 0 for s in scalars),
                 ", ".join(f"{type(s).__name__}{getattr(s, 'shape', '')}" for s in scalars))
            b1, b2, eps, wd = (float(s.asnumpy()) for s in (beta1, beta2, epsilon, decay))
            need(op, "scalars", eps > 0 and 0 < b1 < 1 and 0 < b2 < 1 and wd >= 0,
                 f"beta1={b1}, beta2={b2}, epsilon={eps}, decay={wd}")
            return self.real(var, m, v, lr, beta1, beta2, epsilon, decay, gradient)

    return AdamWeightDecay


def install(patch=setattr) -> dict[str, int]:
    """Replace the fused ops and the optimizer kernel with the twins (``patch``: ``monkeypatch.setattr``
    in tests, plain ``setattr`` in a worker process); returns the call count of each op."""
    calls = install_fused(patch)
    patch(ops, "AdamWeightDecay", adam_weight_decay_twin(ops.AdamWeightDecay, calls))
    return calls


def reduce_scatter_tensor_twin(all_reduce, group_size, group_rank, calls: dict[str, int]):
    """A function standing in for ``mint.distributed.reduce_scatter_tensor``: checks each call, then
    sums a copy of ``input`` with the real (CPU) ``all_reduce`` and writes this rank's chunk into
    ``output`` when the handle is waited for. ``group_size``/``group_rank``: of a group name."""

    class Handle:
        def __init__(self, pending, total, output, lo: int, hi: int):
            self.pending, self.total, self.output, self.lo, self.hi = pending, total, output, lo, hi

        def wait(self) -> None:
            self.pending.wait()
            chunk = self.total[self.lo:self.hi]
            self.output.copy_(ops.where(Tensor(True), chunk, chunk))  # a slice view: the CPU copy_ wants a tensor

    def reduce_scatter_tensor(output, input, op="sum", group=None, async_op=False):  # noqa: A002
        name = "reduce_scatter_tensor"
        calls[name] = calls.get(name, 0) + 1
        need(name, "args", isinstance(output, Tensor) and isinstance(input, Tensor) and output.dtype == input.dtype
             and op in ("sum", "prod", "min", "max", "avg") and isinstance(group, str) and isinstance(async_op, bool),
             f"output {getattr(output, 'dtype', type(output))}, input {getattr(input, 'dtype', type(input))}, "
             f"op {op!r}, group {group!r}, async_op {async_op!r}")
        size, n = group_size(group), input.shape[0]
        need(name, "shape", n % size == 0 and tuple(output.shape) == (n // size, *input.shape[1:]),
             f"input {input.shape}, output {output.shape}, group size {size}")
        total = ops.where(Tensor(True), input, input)  # a copy: all_reduce works in place
        lo = group_rank(group) * (n // size)
        handle = Handle(all_reduce(total, op=op, group=group, async_op=True), total, output, lo, lo + n // size)
        if async_op:
            return handle
        handle.wait()
        return None

    return reduce_scatter_tensor
