"""Run the self-test's checks on this process's device, one :class:`Row` each, within stated budgets.

Error measure: ``max |device - reference| / max |reference|`` over every compared array of a check
(relative to the reference's scale, so near-zero entries do not blow it up). Tolerances are per
compute dtype: bf16 keeps 8 mantissa bits (relative step 2**-8 = 0.0039), fp16 11 (0.00049);
kernels that reduce (norms, softmax, matmul) get a few steps more.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import NamedTuple

import mindspore as ms
import numpy as np

from finetune.selftest import checks
from jobspec.platform import by_target

TOLERANCE = {"bfloat16": {"elementwise": 8e-3, "reduce": 2e-2, "model": 5e-2},
             "float16": {"elementwise": 2e-3, "reduce": 5e-3, "model": 2e-2}}
VERSIONS_FIX = "check the driver/firmware/CANN/MindSpore versions against the supported pair above"


@dataclass
class Row:
    name: str
    shape: str
    dtype: str
    max_rel_err: float | None
    tolerance: float
    ok: bool
    seconds: float
    budget_s: float
    contract: str
    fix: str
    error: str = ""


@dataclass(frozen=True)
class Spec:
    """One check: ``run(layout, dtype, rng)`` -> (device arrays, reference arrays)."""

    name: str
    kind: str  # elementwise | reduce | model: picks the tolerance
    budget_s: float  # per layout, on an NPU (the CPU run is scaled down)
    contract: str
    fix: str
    run: Callable
    shape: Callable[[checks.Layout], str]


def _tokens(lay: checks.Layout, last: int) -> str:
    return f"T={lay.tokens} ({len(lay.ends)} seqs) x {last}"


NO_KEY = "no recipe key turns the fused kernels off (launch.device=cpu runs without them)"


def specs(device: str) -> list[Spec]:
    """Every check, in order; the budgets add up to under two minutes on an NPU by design."""
    heads = lambda lay: f"T={lay.tokens} ({len(lay.ends)} seqs) x N={lay.heads}/{lay.kv_heads} x D={lay.head_dim}"  # noqa: E731 - a one-line label
    out = [
        Spec("rms_norm", "reduce", 3.0, "rms_norm (RmsNorm: x and gamma in x's dtype)", f"{VERSIONS_FIX}; {NO_KEY}",
             checks.check_rms_norm, lambda lay: _tokens(lay, lay.hidden)),
        Spec("rope", "elementwise", 3.0, "rotary_position_embedding (BSND x, cos/sin BS1D, mode 0)",
             f"{VERSIONS_FIX}; {NO_KEY}", checks.check_rope, heads),
        Spec("swiglu", "elementwise", 3.0, "swiglu (split of the last dim)", f"{VERSIONS_FIX}; {NO_KEY}",
             checks.check_swiglu, lambda lay: _tokens(lay, 2 * lay.inter)),
        Spec("flash_attention_fwd", "reduce", 8.0, "flash_attention_score (TND, sparse_mode 3, causal block)",
             f"{VERSIONS_FIX}; {NO_KEY}", checks.check_flash_forward, heads),
        Spec("flash_attention_bwd", "reduce", 12.0, "FlashAttentionScoreGrad (TND, sparse_mode 3)",
             f"{VERSIONS_FIX}; train.recompute does not avoid it; {NO_KEY}", checks.check_flash_backward, heads),
    ]
    for name in checks.matmul_shapes(checks.layouts(device)[0]):
        out.append(Spec(f"matmul_{name}", "reduce", 2.0, "MatMul in the compute dtype", VERSIONS_FIX,
                        checks.check_matmul(name), partial(_matmul_shape, name)))
    return out


def _matmul_shape(name: str, lay: checks.Layout) -> str:
    return "x".join(map(str, (lay.tokens,) + checks.matmul_shapes(lay)[name]))


def compare(got: list[np.ndarray], ref: list[np.ndarray]) -> float:
    """The largest error of the arrays, each relative to its reference's largest magnitude (inf: a non-finite value)."""
    err = 0.0
    for g, r in zip(got, ref, strict=True):
        if g.shape != r.shape:
            raise ValueError(f"shape {g.shape} != reference {r.shape}")
        if not np.all(np.isfinite(g)):
            return float("inf")
        err = max(err, float(np.abs(g - r).max() / max(np.abs(r).max(), 1e-30)))
    return err


def _row(name: str, shape: str, dtype, tol: float, budget: float, contract: str, fix: str,
         fn: Callable[[], tuple[list, list]]) -> Row:
    t0 = time.perf_counter()
    err, error = None, ""
    try:
        err = compare(*fn())
    except Exception as e:  # a kernel that refuses the call is this row's failure
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    seconds = time.perf_counter() - t0
    ok = err is not None and err <= tol
    return Row(name, shape, str(dtype).lower().replace("mindspore.", ""), err, tol, ok, round(seconds, 3), budget,
               contract, "" if ok else fix, error)


class Budget(NamedTuple):
    name: str
    budget_s: float


OPTIMIZER, TINY = Budget("optimizer_step", 5.0), Budget("tiny_qwen2_fwd_bwd", 10.0)


def device_budget_s(device: str) -> float:
    """The sum of one device's check budgets (every NPU runs its checks at the same time)."""
    per_layout = sum(s.budget_s for s in specs(device))
    return len(checks.layouts(device)) * per_layout + OPTIMIZER.budget_s + TINY.budget_s


def run_device_checks(device: str, dtype, seed: int = 0) -> list[Row]:
    """Every op check at every layout, the optimizer step and the tiny model, on this process's device."""
    dname = str(dtype).lower().replace("mindspore.", "")
    tol = TOLERANCE[dname]
    rows = []
    for lay in checks.layouts(device):
        for s in specs(device):
            rng = np.random.default_rng(seed)
            rows.append(_row(f"{s.name}/{lay.name}", s.shape(lay), dtype, tol[s.kind], s.budget_s, s.contract, s.fix,
                             partial(s.run, lay, dtype, rng)))
    lay = checks.layouts(device)[0]
    rows.append(_row(OPTIMIZER.name, f"{lay.hidden}x{lay.hidden} + {lay.hidden}, 2 steps", dtype, tol["reduce"],
                     OPTIMIZER.budget_s, "AdamW: the update is written to the fp32 masters and the parameters",
                     "the optimizer's update kernel wrote nothing or the wrong values: "
                     f"{VERSIONS_FIX}; report it with selftest.json",
                     partial(checks.check_optimizer, lay, dtype, np.random.default_rng(seed))))
    rows.append(_row(TINY.name, "2 layers, hidden 64, T=64 (3 seqs)", dtype, tol["model"], TINY.budget_s,
                     "the model's fused path (all four kernels and their backward) equals its reference path",
                     f"{VERSIONS_FIX}; a single failing op row above names the kernel",
                     partial(checks.check_tiny_model, dtype, np.random.default_rng(seed))))
    return rows


def compute_dtype(device: str):
    """bf16 on Ascend (what training uses); fp16 on CPU (no bf16 matmul there)."""
    return ms.bfloat16 if by_target(device).bf16_matmul else ms.float16


def as_dicts(rows: list[Row]) -> list[dict]:
    return [asdict(r) for r in rows]
