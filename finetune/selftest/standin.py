"""The bf16 stand-in behind the tiny-model row's tolerance (docs/ascend-contracts.md, "tiny model tolerance").

No bf16 matmul runs on CPU, so the stand-in is the same check in fp16 through the contract twins, its error
scaled by the ratio of the unit roundoffs, bf16 2**-8 over fp16 2**-11 = 8 (rounding error grows linearly with
the unit roundoff to first order). ``python -m finetune.selftest.standin [SEEDS]`` prints the table.
"""
from __future__ import annotations

import sys

import numpy as np

UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11}
BF16_PER_FP16 = UNIT_ROUNDOFF["bfloat16"] / UNIT_ROUNDOFF["float16"]
SEEDS = 20


def model_errors(seeds: int = SEEDS) -> list[tuple[float, float]]:
    """(loss error, gradient error) of the fp16 tiny-model check, one per seed 0..seeds-1, as the runner
    measures them (``runner.compare`` of each array)."""
    import mindspore as ms

    from finetune.selftest import checks, runner

    out, models = [], checks.tiny_models(ms.float16)
    for seed in range(seeds):
        got, ref = checks.check_tiny_model(ms.float16, np.random.default_rng(seed), models)
        out.append((runner.compare(got[:1], ref[:1]), runner.compare(got[1:], ref[1:])))
    return out


def main(argv: list[str]) -> int:
    import mindspore as ms

    from finetune.dist import set_device
    from finetune.selftest.runner import TOLERANCE
    from finetune.selftest.twins import install_fused

    ms.set_context(mode=ms.PYNATIVE_MODE)
    set_device("CPU", None)
    install_fused()
    errs = model_errors(int(argv[0]) if argv else SEEDS)
    print("| seed | loss err fp16 | grad err fp16 | bf16 stand-in (x8) |\n|---|---|---|---|")
    for seed, (loss, grad) in enumerate(errs):
        print(f"| {seed} | {loss:.2e} | {grad:.2e} | {BF16_PER_FP16 * max(loss, grad):.2e} |")
    worst = BF16_PER_FP16 * max(max(e) for e in errs)
    tol = TOLERANCE["bfloat16"]["model"]
    print(f"worst bf16 stand-in {worst:.2e}, tolerance {tol:.0e} ({worst / tol:.0%} of it; required: under 50%)")
    return 0 if worst < tol / 2 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
