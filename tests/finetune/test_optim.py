"""AdamW, clipping, schedule and loss scaling against torch goldens / exact expectations."""
import json
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

from finetune.dist import RankInfo
from finetune.optim import AdamW, LossScaler, lr_at
from jobspec.config import LossScaleConfig, TrainConfig

GOLDEN = json.loads((Path(__file__).parent / "golden" / "adamw.json").read_text())


def _params():
    return [ms.Parameter(ms.Tensor(np.array(GOLDEN["init"][k], np.float32)), name=k) for k in ("w", "b")]


def test_adamw_matches_torch_with_clipping():
    params = _params()
    opt = AdamW(params, TrainConfig(lr=1e-2, clip_grad=1.0), RankInfo())
    norms = []
    for g, lr in zip(GOLDEN["grads"], GOLDEN["lrs"]):
        grads = tuple(ms.Tensor(np.array(g[k], np.float32)) for k in ("w", "b"))
        norm, ok = opt.step(grads, lr)
        assert bool(ok.asnumpy())
        norms.append(float(norm.asnumpy()))
    np.testing.assert_allclose(norms, GOLDEN["norms"], rtol=1e-5)
    for p, k in zip(params, ("w", "b")):
        np.testing.assert_allclose(p.asnumpy(), np.array(GOLDEN["final"][k]), rtol=1e-5, atol=1e-6)


def test_grad_scale_unscales_and_overflow_skips():
    a, b = _params(), _params()
    oa = AdamW(a, TrainConfig(lr=1e-2), RankInfo())
    ob = AdamW(b, TrainConfig(lr=1e-2), RankInfo())
    g = [np.array(GOLDEN["grads"][0][k], np.float32) for k in ("w", "b")]
    oa.step(tuple(ms.Tensor(x) for x in g), 1e-2)
    ob.step(tuple(ms.Tensor(x * 1024) for x in g), 1e-2, grad_scale=ms.Tensor(1024.0, ms.float32))
    for p, q in zip(a, b):
        np.testing.assert_allclose(p.asnumpy(), q.asnumpy(), rtol=1e-6)
    before = [p.asnumpy().copy() for p in a]
    norm, ok = oa.step(tuple(ms.Tensor(np.full_like(x, np.inf)) for x in g), 1e-2)
    assert not bool(ok.asnumpy()) and int(oa.corrections.count()) == 1
    for p, x in zip(a, before):
        np.testing.assert_array_equal(p.asnumpy(), x)


def _run_with_a_bad_step(bad_at: int | None, clip: float, on_device: bool) -> tuple[list, dict, int]:
    """Three golden steps (a non-finite one before step ``bad_at``): (weights, optimizer state, applied steps)."""
    grads = [tuple(ms.Tensor(np.array(g[k], np.float32)) for k in ("w", "b")) for g in GOLDEN["grads"][:3]]
    bad = tuple(ms.Tensor(np.where(np.arange(x.size).reshape(x.shape) % 2, np.nan, np.inf).astype(np.float32))
                for x in grads[0])
    params = _params()
    opt = AdamW(params, TrainConfig(lr=1e-2, clip_grad=clip), RankInfo())
    opt.gate.on_device = on_device
    for i, g in enumerate(grads):
        if i == bad_at:
            state = opt.state_dict()
            _, ok = opt.step(bad, 1e-2)
            assert not bool(ok.asnumpy())
            assert all(np.array_equal(v, state[k]) for k, v in opt.state_dict().items())
        opt.step(g, 1e-2)
    return [p.asnumpy() for p in params], opt.state_dict(), int(opt.corrections.count())


@pytest.mark.parametrize("bad_at", [0, 1])
@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_a_skipped_step_changes_nothing_and_the_run_goes_on_as_without_it(bad_at, clip):
    """Decided on the device (Ascend: zeroed gradients, lr 0, the old moments kept) or on the host
    (CPU: no kernel call): weights, moments and the applied-step count stay bit for bit, also for a
    first step, and the steps after it are those of a run that never saw it, in both gates alike."""
    ref_w, ref_state, ref_count = _run_with_a_bad_step(None, clip, on_device=False)
    assert ref_count == 3
    for on_device in (True, False):
        w, state, count = _run_with_a_bad_step(bad_at, clip, on_device)
        assert count == 3
        for a, b in zip(w, ref_w):
            np.testing.assert_array_equal(a, b, err_msg=f"on_device={on_device}")
        assert state.keys() == ref_state.keys()
        assert all(np.array_equal(v, ref_state[k]) for k, v in state.items()), on_device


def test_state_dict_round_trip_continues_identically():
    a, b = _params(), _params()
    oa = AdamW(a, TrainConfig(lr=1e-2), RankInfo())
    grads = [tuple(ms.Tensor(np.array(g[k], np.float32)) for k in ("w", "b")) for g in GOLDEN["grads"]]
    oa.step(grads[0], 1e-2)
    for p, q in zip(b, a):
        p.set_data(ms.Tensor(q.asnumpy()))
    ob = AdamW(b, TrainConfig(lr=1e-2), RankInfo())
    ob.load_state_dict(oa.state_dict())
    for g in grads[1:]:
        oa.step(g, 1e-2)
        ob.step(g, 1e-2)
    for p, q in zip(a, b):
        np.testing.assert_array_equal(p.asnumpy(), q.asnumpy())


def test_lr_schedule_warmup_then_cosine_to_min():
    cfg = TrainConfig(lr=1.0, warmup_steps=4, schedule="cosine", min_lr=0.1)
    assert [lr_at(s, cfg, 14) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, cfg, 14) == pytest.approx(1.0)
    assert lr_at(9, cfg, 14) == pytest.approx(0.55)
    assert lr_at(14, cfg, 14) == pytest.approx(0.1)
    assert lr_at(7, TrainConfig(lr=0.5, schedule="constant"), 14) == 0.5


def test_loss_scaler_backs_off_and_grows():
    s = LossScaler(LossScaleConfig(initial=2.0 ** 16, growth_interval=2), enabled=True)
    yes, no = ms.Tensor(True), ms.Tensor(False)
    s.update(no)
    assert float(s.scale.asnumpy()) == 2.0 ** 15
    s.update(yes)
    s.update(yes)
    assert float(s.scale.asnumpy()) == 2.0 ** 16 and s.state_dict() == {"scale": 2.0 ** 16, "good_steps": 0}
    s.update(yes)
    assert s.state_dict() == {"scale": 2.0 ** 16, "good_steps": 1}
    low = LossScaler(LossScaleConfig(initial=1.0), enabled=True)
    low.update(no)
    assert float(low.scale.asnumpy()) == 1.0  # never below 1
    off = LossScaler(LossScaleConfig(), enabled=False)
    off.update(no)
    assert float(off.scale.asnumpy()) == 1.0 and off.grad_scale is None


def test_skipped_steps_are_counted_on_the_device_until_read():
    from finetune.optim import SkippedSteps

    s = SkippedSteps()
    for ok in (True, False, False, True, False):
        s.update(ms.Tensor(ok))
    assert s.counts.asnumpy().tolist() == [3.0, 1.0, 2.0]  # skipped, current run, longest run
    s.read()
    s.update(ms.Tensor(False))
    assert s.counts.asnumpy().tolist() == [1.0, 2.0, 2.0]


@pytest.mark.parametrize("on_host", [False, True])  # MindSpore's ops (Ascend's path), numpy (CPU's)
@pytest.mark.parametrize("n", [5, 64, 1_216_681])
def test_the_gradient_norm_is_the_same_whatever_ran_before(n, on_host, monkeypatch):
    """Exact resume needs the norm (hence the clip factor) to depend only on the gradients. MindSpore's
    CPU full ops.sum over 1.2M floats gave a different last bit in 3 of 200 calls interleaved with other
    reductions (a resumed run's weights then differed from an uninterrupted run's); the row partials
    summed on the host must give one value."""
    from mindspore import ops

    from finetune.parallel import grads
    from finetune.parallel.grads import global_grad_norm

    rng = np.random.default_rng(0)
    g = [ms.Tensor(rng.standard_normal(n).astype(np.float32) * 1e-3)]
    p = [ms.Parameter(ops.zeros((n,), ms.float32), name="p")]
    real, host_calls = grads.host_square_partials, []  # so on_host=True really takes the numpy path
    monkeypatch.setattr(grads, "host_square_partials", lambda x: host_calls.append(1) or real(x))
    want = float(np.sqrt((g[0].asnumpy().astype(np.float64) ** 2).sum()))
    seen = set()
    for i in range(150):
        if i % 3 == 0:  # other reductions of random sizes in between, as a training step has
            ops.sum(ops.square(ms.Tensor(rng.standard_normal(int(rng.integers(1000, 2_000_000)), np.float32))))
        seen.add(float(global_grad_norm(g, p, RankInfo(), on_host).asnumpy()))
    assert len(seen) == 1
    assert seen.pop() == pytest.approx(want, rel=1e-6)
    assert bool(host_calls) == on_host


def _kernel_args(n: int, seed: int = 0) -> tuple[list[np.ndarray], tuple[float, ...]]:
    rng = np.random.default_rng(seed)
    w, m, g = (rng.standard_normal(n, dtype=np.float32) * s for s in (1.0, 1e-2, 1e-2))
    v = np.abs(rng.standard_normal(n, dtype=np.float32)) * 1e-4
    return [w, m, v, g], (1e-3, 0.9, 0.95, 1e-8)


@pytest.mark.parametrize("wd, coef", [(0.0, None), (0.1, None), (0.1, 0.3712)])
def test_the_host_kernel_gives_the_composed_kernels_bits_in_place(wd, coef):
    """CPU's AdamW kernel (optim/host.py) writes adamw_update's step into w, m, v where they are, bit for bit
    (over several of its chunks and a ragged end); with a clip factor, that of the gradient times it."""
    from mindspore import ops

    from finetune import hostmem
    from finetune.optim import host
    from finetune.optim.update import KernelScalars, adamw_update

    arrays, scalars = _kernel_args(3 * host.CHUNK + 5)
    f32 = [ms.Tensor(np.float32(s)) for s in scalars]
    w, m, v, g = (ms.Tensor(a) for a in arrays)
    want = adamw_update(w, m, v, g if coef is None else g * ms.Tensor(np.float32(coef)),
                        KernelScalars(*f32, ms.Tensor(np.float32(1.0))), ms.Tensor(np.float32(wd)))
    w, m, v, g = (ops.add(ms.Tensor(a), 0.0) for a in arrays)  # tensors on their own memory
    addresses = [t.data_ptr() for t in (w, m, v)]
    own = [hostmem.own_memory(t) for t in (w, m, v)]
    host.adamw_update_host(*own, g.asnumpy(), *scalars, wd, coef)
    assert [t.data_ptr() for t in (w, m, v)] == addresses
    for got, expect in zip((w, m, v), want):
        np.testing.assert_array_equal(got.asnumpy(), expect.asnumpy())


@pytest.mark.parametrize("on_device, in_place", [(False, True), (False, False), (True, False)])
def test_clipping_copies_no_more_than_one_gradient_at_a_time(on_device, in_place, monkeypatch):
    """Issue 30: the clip factor is applied as the update reads each gradient (StepGate.clip), not to every
    gradient before the first update, which held a second fp32 copy of the step's totals at its peak. The host
    kernel applies it chunk by chunk (no copy); the composed kernel to one gradient at a time. The weights are
    those of every gradient clipped first."""
    import weakref

    rng = np.random.default_rng(0)
    shapes = [(64, 32), (32,), (128, 16), (8, 8)]
    grads = tuple(ms.Tensor(rng.standard_normal(s).astype(np.float32)) for s in shapes)
    init = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    alive: list = []
    most = 0
    original = ms.Tensor.__mul__

    def mul(self, other):
        nonlocal most
        out = original(self, other)
        if any(self is g for g in grads):
            alive.append(weakref.ref(out))
            most = max(most, sum(r() is not None for r in alive))
        return out

    finals = []
    for count in (True, False):
        params = [ms.Parameter(ms.Tensor(x), name=f"p{i}") for i, x in enumerate(init)]
        opt = AdamW(params, TrainConfig(lr=1e-2, clip_grad=0.01), RankInfo())  # the norm is about 60: clipped
        opt.gate.on_device, opt.gate.in_place = on_device, in_place
        if count:
            monkeypatch.setattr(ms.Tensor, "__mul__", mul)
            opt.step(grads, 1e-2)
            monkeypatch.undo()
        else:  # the reference: every gradient clipped before the step, no clip factor left to apply
            coef = np.float32(0.01) / (np.float32(np.sqrt(sum(float((g.asnumpy().astype(np.float64) ** 2).sum())
                                                              for g in grads))) + np.float32(1e-6))
            opt.cfg = TrainConfig(lr=1e-2, clip_grad=0.0)
            opt.step(tuple(ms.Tensor(g.asnumpy() * coef) for g in grads), 1e-2)
        finals.append([p.asnumpy().copy() for p in params])
    assert most == (0 if in_place else 1), most
    for a, b in zip(*finals):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_own_memory_is_refused_for_a_view_whose_array_would_be_a_copy():
    """asnumpy of a slice is a copy (a write to it would be lost): own_memory says None, and the optimizer
    then uses the composed kernel; a whole tensor's array writes through."""
    from finetune import hostmem

    t = ms.Parameter(ms.Tensor(np.zeros(8, np.float32)), name="t")
    assert hostmem.own_memory(t[2:5]) is None and hostmem.own_memory(t.astype(ms.float16)) is None
    hostmem.own_memory(t)[3] = 7.0
    assert t.asnumpy()[3] == 7.0


def test_the_cpu_optimizer_steps_in_place_as_the_composed_kernel_and_snapshots_its_state():
    """On CPU AdamW updates its fp32 weights and moments in place (no new tensors per step) with the bits of
    the composed kernel; state_dict is a copy the next steps leave alone."""
    grads = [tuple(ms.Tensor(np.array(g[k], np.float32)) for k in ("w", "b")) for g in GOLDEN["grads"]]
    runs = []
    for in_place in (True, False):
        params = _params()
        opt = AdamW(params, TrainConfig(lr=1e-2, clip_grad=1.0, weight_decay=0.1), RankInfo())
        opt.gate.in_place = in_place
        moments = list(opt.m)
        opt.step(grads[0], 1e-2)
        state = opt.state_dict()
        saved = {k: v.copy() for k, v in state.items()}
        for g in grads[1:]:
            opt.step(g, 1e-2)
        assert all(np.array_equal(v, saved[k]) for k, v in state.items())
        assert all(a is b for a, b in zip(opt.m, moments)) == in_place
        runs.append([p.asnumpy().copy() for p in params] + list(opt.state_dict().values()))
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
