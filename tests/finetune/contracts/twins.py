"""Contract twins for the tests: the fused-kernel twins (``finetune.selftest.twins``, which the self-test
runs on CPU) plus the optimizer kernel's and the sharded optimizer's reduce-scatter twins.

Sources beyond those of ``finetune.selftest.twins``:

- ``MS-ADAMWD``: MindSpore 2.10 ``ops.AdamWeightDecay`` docstring and ``__mindspore_signature__``
  (``mindspore/ops/auto_generate/gen_ops_prim.py``); its "Outputs" are the updated var, m, v.
- ``FT-OPT``: the optimizer kernel ``finetune.optim.update.adamw_update`` (its docstring; issue 18 section 1.3):
  fp32 inputs, fp32 scalar hyper-parameters, results returned as new tensors, no input written.
- ``MS-COMM``: MindSpore 2.10 ``mint.distributed.reduce_scatter_tensor`` docstring
  (``mindspore/mint/distributed/distributed.py``): the native reduce-scatter of the sharded
  optimizer's gradient buckets on Ascend (the CPU backend has no ReduceScatter kernel).
- ``MS-DDP``: MindSpore 2.10 ``mindspore/parallel/distributed/flatten_grad_buffer.py``: its
  DistributedDataParallel keeps the bucket it hands to the asynchronous all-reduce referenced until
  ``communication_handle.wait()``.
- ``MS-HOOK``: MindSpore 2.10 ``Tensor.register_hook`` docstring (``mindspore/common/tensor.py``):
  "hook(grad) -> New output gradient, but can not return None or not set return value".

``install(monkeypatch.setattr)`` puts every twin in place (the fused ops on ``mindspore.ops`` and the optimizer
kernel ``finetune.optim.update.adamw_update``); the model's fused path (``RankInfo(device_target="Ascend")``) then
runs on CPU.
"""
from __future__ import annotations

import weakref

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from finetune.selftest.twins import CONTRACTS as FUSED_CONTRACTS
from finetune.selftest.twins import (  # noqa: F401 - re-exported for the contract tests
    ContractError,
    Rule,
    flash_attention_score,
    install_fused,
    rms_norm,
    rotary_position_embedding,
    swiglu,
)
from finetune.selftest.twins import need as _need

CONTRACTS: dict[tuple[str, str], Rule] = {
    **FUSED_CONTRACTS,
    # AdamWeightDecay
    ("AdamWeightDecay", "dtype"): Rule("var, m, v are float16 or float32; m and v share a dtype; gradient has "
                                       "var's dtype (signature groups T, T1)", "MS-ADAMWD Inputs, signature"),
    ("AdamWeightDecay", "shape"): Rule("m, v and gradient have var's shape", "MS-ADAMWD Inputs"),
    ("AdamWeightDecay", "scalars"): Rule("lr, beta1, beta2, epsilon, decay are float32 scalars; epsilon > 0, "
                                         "beta1/beta2 in (0, 1), decay >= 0", "MS-ADAMWD Inputs, Raises"),
    # finetune.optim.update.adamw_update, the optimizer kernel
    ("adamw_update", "dtype"): Rule("w, m, v and the gradient are float32", "FT-OPT"),
    ("adamw_update", "shape"): Rule("m, v and the gradient have w's shape", "FT-OPT"),
    ("adamw_update", "scalars"): Rule("lr, beta1, beta2, eps, decay_factor and wd are float32 0-d tensors; eps > 0, "
                                      "beta1/beta2 in (0, 1), wd >= 0", "FT-OPT; MS-ADAMWD Raises"),
    # mint.distributed.reduce_scatter_tensor
    ("reduce_scatter_tensor", "args"): Rule("output and input are Tensors of the same dtype; op is one of sum, "
                                            "prod, min, max, avg; group is a str; async_op is a bool",
                                            "MS-COMM Args output/input/op/group/async_op, Raises TypeError"),
    ("reduce_scatter_tensor", "lifetime"): Rule("the input buffer stays referenced by the caller until wait() "
                                                "returns", "MS-DDP; issue 18 section 1.4"),
    ("all_reduce", "lifetime"): Rule("the buffer summed in place stays referenced by the caller until wait() "
                                     "returns", "MS-DDP; issue 18 section 1.4"),
    # Tensor.register_hook / Parameter.register_hook
    ("register_hook", "returns"): Rule("the hook returns the gradient (a Tensor), never None", "MS-HOOK"),
    ("reduce_scatter_tensor", "shape"): Rule("input is (N, *) with N divisible by the group size; output is "
                                             "(N / group size, *)", "MS-COMM Args output/input"),
}


def need(op: str, key: str, ok: bool, got: str) -> None:
    _need(op, key, ok, got, CONTRACTS)


def _adamw_reference(var, m, v, grad, lr, beta1, beta2, eps, decay) -> tuple[Tensor, Tensor, Tensor]:
    """The AdamWeightDecay formula in float64 on the host, as NEW fp32 tensors (nothing written)."""
    w, m0, v0, g = (x.asnumpy().astype(np.float64) for x in (var, m, v, grad))
    lr, b1, b2, eps, wd = (float(s.asnumpy()) for s in (lr, beta1, beta2, eps, decay))
    m1 = b1 * m0 + (1 - b1) * g
    v1 = b2 * v0 + (1 - b2) * g * g
    w1 = w - lr * (m1 / (np.sqrt(v1) + eps) + wd * w)
    return tuple(Tensor(x.astype(np.float32)) for x in (w1, m1, v1))


def _check_adamw_scalars(op: str, scalars: tuple) -> None:
    need(op, "scalars", all(isinstance(s, Tensor) and s.dtype == ms.float32 and s.ndim == 0 for s in scalars),
         ", ".join(f"{type(s).__name__}{getattr(s, 'shape', '')}" for s in scalars))


def adam_weight_decay_twin(calls: dict[str, int]):
    """A strict stand-in for ``ops.AdamWeightDecay``: checks each call and returns its documented outputs
    (the updated var, m, v) as new tensors, writing none of its inputs: a caller that relies on the
    kernel writing plain tensors in place (undocumented in PyNative) learns nothing under it."""

    class AdamWeightDecay:
        def __init__(self, use_locking=False):
            self.use_locking = use_locking

        def __call__(self, var, m, v, lr, beta1, beta2, epsilon, decay, gradient):
            op = "AdamWeightDecay"
            calls[op] = calls.get(op, 0) + 1
            f16_32 = (ms.float16, ms.float32)
            need(op, "dtype", var.dtype in f16_32 and m.dtype in f16_32 and v.dtype == m.dtype
                 and gradient.dtype == var.dtype, f"var {var.dtype}, m {m.dtype}, v {v.dtype}, grad {gradient.dtype}")
            need(op, "shape", m.shape == var.shape and v.shape == var.shape and gradient.shape == var.shape,
                 f"var {var.shape}, m {m.shape}, v {v.shape}, grad {gradient.shape}")
            _check_adamw_scalars(op, (lr, beta1, beta2, epsilon, decay))
            b1, b2, eps, wd = (float(s.asnumpy()) for s in (beta1, beta2, epsilon, decay))
            need(op, "scalars", eps > 0 and 0 < b1 < 1 and 0 < b2 < 1 and wd >= 0,
                 f"beta1={b1}, beta2={b2}, epsilon={eps}, decay={wd}")
            return _adamw_reference(var, m, v, gradient, lr, beta1, beta2, epsilon, decay)

    return AdamWeightDecay


def adamw_update_twin(calls: dict[str, int]):
    """A strict stand-in for ``finetune.optim.update.adamw_update``: checks the call, computes the reference in
    float64 and returns new tensors, writing none of its inputs."""

    def adamw_update(w, m, v, g, k, wd):
        op = "adamw_update"
        calls[op] = calls.get(op, 0) + 1
        need(op, "dtype", all(x.dtype == ms.float32 for x in (w, m, v, g)),
             f"w {w.dtype}, m {m.dtype}, v {v.dtype}, g {g.dtype}")
        need(op, "shape", m.shape == w.shape and v.shape == w.shape and g.shape == w.shape,
             f"w {w.shape}, m {m.shape}, v {v.shape}, g {g.shape}")
        _check_adamw_scalars(op, (*k, wd))
        b1, b2, eps, w_d = (float(s.asnumpy()) for s in (k.beta1, k.beta2, k.eps, wd))
        need(op, "scalars", eps > 0 and 0 < b1 < 1 and 0 < b2 < 1 and w_d >= 0,
             f"beta1={b1}, beta2={b2}, eps={eps}, wd={w_d}")
        return _adamw_reference(w, m, v, g, k.lr, k.beta1, k.beta2, k.eps, wd)

    return adamw_update


def install(patch=setattr) -> dict[str, int]:
    """Replace the fused ops and the optimizer kernels with the twins (``patch``: ``monkeypatch.setattr``
    in tests, plain ``setattr`` in a worker process); returns the call count of each op."""
    calls = install_fused(patch)
    patch(ops, "AdamWeightDecay", adam_weight_decay_twin(calls))
    from finetune.optim import update

    patch(update, "adamw_update", adamw_update_twin(calls))
    return calls


def reduce_scatter_tensor_twin(all_reduce, group_size, group_rank, calls: dict[str, int]):
    """A function standing in for ``mint.distributed.reduce_scatter_tensor``: checks each call, then
    sums a copy of ``input`` with the real (CPU) ``all_reduce`` and writes this rank's chunk into
    ``output`` when the handle is waited for. ``group_size``/``group_rank``: of a group name."""

    class Handle:
        def __init__(self, pending, total, output, lo: int, hi: int, source: Tensor):
            self.pending, self.total, self.output, self.lo, self.hi = pending, total, output, lo, hi
            self.source = weakref.ref(source)  # the caller must keep it (rule "lifetime")

        def wait(self) -> None:
            need("reduce_scatter_tensor", "lifetime", self.source() is not None, "the input was freed before wait()")
            self.pending.wait()
            chunk = self.total[self.lo:self.hi]
            self.output.copy_(ops.where(Tensor(True), chunk, chunk))  # a slice view: the CPU copy_ wants a tensor

    def reduce_scatter_tensor(output, input, op="sum", group=None, async_op=False):  # MindSpore's names
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
        handle = Handle(all_reduce(total, op=op, group=group, async_op=True), total, output, lo, lo + n // size, input)
        if async_op:
            return handle
        handle.wait()
        return None

    return reduce_scatter_tensor


def all_reduce_twin(all_reduce, calls: dict[str, int]):
    """A function standing in for ``mint.distributed.all_reduce``: runs the real one; an asynchronous
    call's ``wait()`` first checks that the caller still holds the buffer (rule "lifetime")."""

    class Handle:
        def __init__(self, pending, tensor: Tensor):
            self.pending, self.tensor = pending, weakref.ref(tensor)

        def wait(self) -> None:
            need("all_reduce", "lifetime", self.tensor() is not None, "the buffer was freed before wait()")
            self.pending.wait()

    def twin(tensor, op="sum", group=None, async_op=False):
        calls["all_reduce"] = calls.get("all_reduce", 0) + 1
        pending = all_reduce(tensor, op=op, group=group, async_op=async_op)
        return Handle(pending, tensor) if async_op else pending

    return twin


def register_hook_twin(register_hook, calls: dict[str, int]):
    """A method standing in for ``Parameter.register_hook``: registers the hook wrapped so that each call
    checks it returned a Tensor (rule "returns") and passes that on."""

    def twin(self, hook):
        def checked(grad):
            calls["register_hook"] = calls.get("register_hook", 0) + 1
            out = hook(grad)
            need("register_hook", "returns", isinstance(out, Tensor), f"the hook of {self.name} returned {out!r}")
            return out
        return register_hook(self, checked)

    return twin
