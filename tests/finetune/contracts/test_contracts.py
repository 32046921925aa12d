"""The twins themselves: each contract rule refuses a violating call; valid calls compute the math."""
from __future__ import annotations

import re

import numpy as np
import pytest

from tests.finetune.contracts.twins import CONTRACTS, ContractError
from tests.tolerances import assert_fp32_close

ADAMW_OPS = 12  # an AdamW element's chain: two moments (3 ops each), two bias corrections, sqrt, eps, divide, decay


def T(shape, dtype="float16", seed=0):  # short: used in every test
    import mindspore as ms

    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return ms.Tensor(x).astype(getattr(ms, dtype))


def _fa(**over):
    """A valid TND call (two sequences of 3 and 5 tokens, 4 query / 2 KV heads, D=16), then overrides."""
    import mindspore as ms

    from finetune.model.kernels import causal_block

    args = dict(query=T((8, 4, 16)), key=T((8, 2, 16), seed=1), value=T((8, 2, 16), seed=2), head_num=4,
                attn_mask=causal_block(), actual_seq_qlen=(3, 8), actual_seq_kvlen=(3, 8), scalar_value=0.25,
                next_tokens=0, input_layout="TND", sparse_mode=3)
    if "mask" in over:  # a numpy mask
        over["attn_mask"] = ms.Tensor(over.pop("mask"))
    return {**args, **over}


def _fa_bad_mask():
    m = np.triu(np.ones((2048, 2048), np.uint8), 1)
    m[5, 2] = 1
    return m


def _rope(**over):
    args = dict(x=T((2, 6, 4, 16)), cos=T((2, 6, 1, 16), seed=1), sin=T((2, 6, 1, 16), seed=2), mode=0)
    args.update(over)
    return args


def _adam(**over):
    import mindspore as ms

    f = lambda v: ms.Tensor(v, ms.float32)  # noqa: E731  (a one-line converter)
    w = ms.Parameter(T((3, 4), "float32"), name="w")
    args = dict(var=w, m=ms.Parameter(T((3, 4), "float32") * 0, name="m"),
                v=ms.Parameter(T((3, 4), "float32") * 0, name="v"), lr=f(1e-3), beta1=f(0.9), beta2=f(0.999),
                epsilon=f(1e-8), decay=f(0.01), gradient=T((3, 4), "float32", seed=3))
    args.update(over)
    return args


def _kernel(**over):
    """Arguments of finetune.optim.adamw_update (one step of a 3x4 weight)."""
    from finetune.optim import KernelScalars

    a = _adam()
    args = dict(w=a["var"] * 1, m=a["m"] * 1, v=a["v"] * 1, g=a["gradient"],
                k=KernelScalars(a["lr"], a["beta1"], a["beta2"], a["epsilon"], _f32(1.0)), wd=a["decay"])
    args.update(over)
    return args


def _f32(v: float):
    import mindspore as ms

    return ms.Tensor(v, ms.float32)


def _rs(**over):
    """A reduce-scatter of 8 floats over a group of 2, one argument changed."""
    args = dict(output=T((4,), "float32"), input=T((8,), "float32"), op="sum", group="dp_0", async_op=True)
    args.update(over)
    return args


# (op, rule key, the call's keyword arguments as a thunk)
VIOLATIONS = [
    ("flash_attention_score", "dtype", lambda: _fa(query=T((8, 4, 16), "float32"))),
    ("flash_attention_score", "dtype", lambda: _fa(key=T((8, 2, 16), "bfloat16"))),
    ("flash_attention_score", "tnd_shape", lambda: _fa(value=T((8, 4, 16)))),
    ("flash_attention_score", "head_num", lambda: _fa(head_num=2)),
    ("flash_attention_score", "gqa", lambda: _fa(key=T((8, 3, 16)), value=T((8, 3, 16)))),
    ("flash_attention_score", "head_dim", lambda: _fa(query=T((8, 4, 8)), key=T((8, 2, 8)), value=T((8, 2, 8)))),
    ("flash_attention_score", "seq_given", lambda: _fa(actual_seq_kvlen=None)),
    ("flash_attention_score", "seq_given", lambda: _fa(actual_seq_kvlen=(8,))),
    ("flash_attention_score", "seq_cumulative", lambda: _fa(actual_seq_qlen=(3, 5), actual_seq_kvlen=(3, 5))),
    ("flash_attention_score", "seq_cumulative", lambda: _fa(actual_seq_qlen=(5, 3, 8), actual_seq_kvlen=(5, 3, 8))),
    ("flash_attention_score", "seq_cumulative", lambda: _fa(actual_seq_kvlen=(3, 3, 8), actual_seq_qlen=(3, 3, 8))),
    ("flash_attention_score", "mask_dtype", lambda: _fa(mask=np.triu(np.ones((2048, 2048), np.float32), 1))),
    ("flash_attention_score", "mask_dtype", lambda: _fa(attn_mask=None)),
    ("flash_attention_score", "tnd_mask", lambda: _fa(mask=np.tril(np.ones((2048, 2048), np.uint8)))),
    ("flash_attention_score", "tnd_mask", lambda: _fa(mask=_fa_bad_mask())),
    ("flash_attention_score", "tnd_mask", lambda: _fa(mask=np.triu(np.ones((8, 8), np.uint8), 1))),
    ("flash_attention_score", "tnd_mask", lambda: _fa(sparse_mode=0)),
    ("flash_attention_score", "tnd_tokens", lambda: _fa(next_tokens=2147483647)),
    ("flash_attention_score", "tnd_tokens", lambda: _fa(pre_tokens=4)),
    ("flash_attention_score", "sparse3", lambda: _fa(key=T((6, 2, 16)), value=T((6, 2, 16)),
                                                     actual_seq_kvlen=(3, 6))),
    ("flash_attention_score", "scalars", lambda: _fa(scalar_value=1)),
    ("flash_attention_score", "scalars", lambda: _fa(keep_prob=0.0)),
    ("flash_attention_score", "sizes", lambda: _fa(query=T((600000, 1, 16)), key=T((600000, 1, 16)), head_num=1,
                                                   value=T((600000, 1, 16)), actual_seq_qlen=(600000,),
                                                   actual_seq_kvlen=(600000,))),
    ("flash_attention_score", "emulated", lambda: _fa(input_layout="BNSD")),
    ("rms_norm", "dtype_pair", lambda: dict(x=T((2, 8), "float32"), gamma=T((8,), "bfloat16"))),
    ("rms_norm", "dtype_pair", lambda: dict(x=T((2, 8), "float32"), gamma=T((8,), "float16"))),
    ("rms_norm", "same_dtype", lambda: dict(x=T((2, 8), "bfloat16"), gamma=T((8,), "float32"))),
    ("rms_norm", "shape", lambda: dict(x=T((2, 8)), gamma=T((4,)))),
    ("rms_norm", "epsilon", lambda: dict(x=T((2, 8)), gamma=T((8,)), epsilon=0.0)),
    ("rotary_position_embedding", "dtype", lambda: _rope(cos=T((2, 6, 1, 16), "float32"))),
    ("rotary_position_embedding", "rank", lambda: _rope(x=T((12, 4, 16)))),
    ("rotary_position_embedding", "mode", lambda: _rope(mode=1)),
    ("rotary_position_embedding", "head_dim", lambda: _rope(x=T((2, 6, 4, 896)), cos=T((2, 6, 1, 896)),
                                                            sin=T((2, 6, 1, 896)))),
    ("rotary_position_embedding", "layout", lambda: _rope(cos=T((1, 6, 4, 16)), sin=T((1, 6, 4, 16)))),
    # B = N = 1000 in every reading of the cos pattern (BSND and SBND)
    ("rotary_position_embedding", "layout", lambda: _rope(x=T((1000, 1, 1000, 2)), cos=T((1000, 1, 1, 2)),
                                                          sin=T((1000, 1, 1, 2)))),
    # read as BNSD (cos 11SD), D/2 = 16 fp16 = 32 bytes (aligned), B*N = 64 > 8*S = 16
    ("rotary_position_embedding", "bnsd", lambda: _rope(x=T((4, 16, 2, 32)), cos=T((1, 1, 2, 32)),
                                                        sin=T((1, 1, 2, 32)))),
    # read as BNSD, D/2 = 8 fp16 (unaligned), D < 80, 2*B*N = 128 > ceil(S / 48) = 1
    ("rotary_position_embedding", "bnsd", lambda: _rope(x=T((4, 16, 2, 16)), cos=T((1, 1, 2, 16)),
                                                        sin=T((1, 1, 2, 16)))),
    ("swiglu", "dtype", lambda: dict(input=T((2, 8), "float64"))),
    ("swiglu", "split", lambda: dict(input=T((2, 7)))),
    ("AdamWeightDecay", "dtype", lambda: _adam(gradient=T((3, 4)))),
    ("AdamWeightDecay", "shape", lambda: _adam(gradient=T((4, 3), "float32"))),
    ("AdamWeightDecay", "scalars", lambda: _adam(lr=1e-3)),
    ("AdamWeightDecay", "scalars", lambda: _adam(decay=T((), "float32") * 0 - 1)),
    ("AdamWeightDecay", "scalars", lambda: _adam(beta1=_f32(1.0))),  # once passed on a skipped step
    ("adamw_update", "dtype", lambda: _kernel(g=T((3, 4)))),
    ("adamw_update", "shape", lambda: _kernel(g=T((4, 3), "float32"))),
    ("adamw_update", "scalars", lambda: _kernel(wd=1e-2)),
    ("adamw_update", "scalars", lambda: _kernel(wd=_f32(-1.0))),
    ("reduce_scatter_tensor", "args", lambda: _rs(output=T((4,), "float16"))),
    ("reduce_scatter_tensor", "args", lambda: _rs(group=None)),
    ("reduce_scatter_tensor", "args", lambda: _rs(op="mean")),
    ("reduce_scatter_tensor", "lifetime", lambda: dict(freed=True)),
    ("all_reduce", "lifetime", lambda: dict(freed=True)),
    ("register_hook", "returns", lambda: dict(hook=lambda grad: None)),  # the old overlap hooks returned None
    ("reduce_scatter_tensor", "shape", lambda: _rs(input=T((7,), "float32"))),
    ("reduce_scatter_tensor", "shape", lambda: _rs(output=T((8,), "float32"))),
]


class _Done:
    """A finished collective (the handle a fake all_reduce returns)."""

    def wait(self) -> None:
        pass


def _fake_all_reduce(tensor, op="sum", group=None, async_op=False):
    return _Done() if async_op else None


def _call(op: str, kwargs: dict):
    import gc

    from tests.finetune.contracts import twins

    if kwargs.get("freed"):  # start on a buffer no one keeps, then wait
        if op == "all_reduce":
            handle = twins.all_reduce_twin(_fake_all_reduce, {})(T((8,), "float32") * 1, group="dp_0", async_op=True)
        else:
            handle = twins.reduce_scatter_tensor_twin(_fake_all_reduce, lambda group: 2, lambda group: 0, {})(
                **_rs(input=T((8,), "float32") * 1))
        gc.collect()
        return handle.wait()
    if op == "register_hook":
        import mindspore as ms

        hooks = []
        twins.register_hook_twin(lambda param, hook: hooks.append(hook), {})(
            ms.Parameter(T((2,), "float32"), name="p"), kwargs["hook"])
        return hooks[0](T((2,), "float32"))

    if op == "AdamWeightDecay":
        return twins.adam_weight_decay_twin({})()(**kwargs)
    if op == "adamw_update":
        return twins.adamw_update_twin({})(**kwargs)
    if op == "reduce_scatter_tensor":  # refused before any collective runs
        return twins.reduce_scatter_tensor_twin(None, lambda group: 2, lambda group: 0, {})(**kwargs)
    return getattr(twins, op)(**kwargs)


def test_every_rule_has_a_source_and_a_violation():
    assert all(rule.source for rule in CONTRACTS.values())
    assert {(op, key) for op, key, _ in VIOLATIONS} == set(CONTRACTS)


@pytest.mark.parametrize("op,key,make", VIOLATIONS, ids=[f"{o}-{k}-{i}" for i, (o, k, _) in enumerate(VIOLATIONS)])
def test_violation_is_refused(ms_cpu, op, key, make):
    with pytest.raises(ContractError, match=re.escape(CONTRACTS[(op, key)].text)):
        _call(op, make())


def test_valid_calls_compute_the_reference(ms_cpu):
    ms = ms_cpu
    from finetune.model import kernels

    a = _fa()
    out = _call("flash_attention_score", a).asnumpy().astype(np.float32)
    q, k, v = (a[n].asnumpy().astype(np.float32) for n in ("query", "key", "value"))
    k, v = np.repeat(k, 2, 1), np.repeat(v, 2, 1)
    for lo, hi in ((0, 3), (3, 8)):  # each sequence alone, causal
        s = np.einsum("qhd,khd->hqk", q[lo:hi], k[lo:hi]) * 0.25 + np.triu(np.full((hi - lo,) * 2, -1e30), 1)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        np.testing.assert_allclose(out[lo:hi], np.einsum("hqk,khd->qhd", p, v[lo:hi]), atol=2e-3)

    x, g = T((2, 3, 8)), T((8,), seed=1)
    y, rstd = _call("rms_norm", dict(x=x, gamma=g))
    ref = kernels.rms_norm(x, g, 1e-6, fused=False)
    np.testing.assert_allclose(y.asnumpy(), ref.asnumpy(), atol=2e-3)
    assert y.dtype == ms.float16 and rstd.dtype == ms.float32 and rstd.shape == (2, 3, 1)

    r = _rope()
    np.testing.assert_allclose(_call("rotary_position_embedding", r).asnumpy(),
                               kernels.rope(r["x"], r["cos"], r["sin"], fused=False).asnumpy(), rtol=2e-3, atol=2e-3)
    gate, up = T((2, 8)), T((2, 8), seed=1)
    from mindspore import ops

    np.testing.assert_allclose(_call("swiglu", dict(input=ops.cat((gate, up), -1))).asnumpy(),
                               kernels.swiglu(gate, up, fused=False).asnumpy(), atol=2e-3)
    adam = _adam()
    inputs = {k: v.asnumpy().copy() for k, v in adam.items()}
    outputs = _call("AdamWeightDecay", adam)
    assert all(np.array_equal(v.asnumpy(), inputs[k]) for k, v in adam.items())  # strict: nothing written
    from finetune.optim import adamw_update

    kernel = _kernel()
    inputs = {k: v.asnumpy().copy() for k, v in kernel.items() if k != "k"}
    ours = adamw_update(**kernel)  # the project's kernel, documented ops only
    assert all(np.array_equal(kernel[k].asnumpy(), inputs[k]) for k in inputs)  # writes none of its inputs
    twin = _call("adamw_update", kernel)
    assert all(np.array_equal(kernel[k].asnumpy(), inputs[k]) for k in inputs)
    for new, ref, old in zip(ours, twin, outputs):
        assert_fp32_close(new.asnumpy(), ref.asnumpy(), ADAMW_OPS)  # elementwise: no sums, a chain of ops
        assert_fp32_close(old.asnumpy(), ref.asnumpy(), ADAMW_OPS)
    assert not np.allclose(ours[0].asnumpy(), inputs["w"])
