"""Issue 31 item 1: every shipped recipe that runs on CPU (recipes/tiny-cpu*.yaml) passes as ``make train`` runs it
(through the launcher, the inference check on), exits 0 and writes every output docs/training.md lists for it."""
from __future__ import annotations

import os
import subprocess

import pytest

from jobspec.config import REPO_ROOT
from jobspec.rundir import ENTRIES, RunDir

CPU_RECIPES = sorted(p.stem for p in (REPO_ROOT / "recipes").glob("tiny-cpu*.yaml"))
# what docs/training.md's table says is written only in other cases: NPU samples (NPUs), the profile (profile_steps),
# the evaluation (make eval, or eval.after_training)
ELSEWHERE = {"npu_log", "profile", "eval"}
SHORT = "train.max_steps=4 train.save_every=2 train.eval_every=2 export.check_max_new_tokens=4"


def test_the_cpu_recipes_are_found():
    assert {"tiny-cpu", "tiny-cpu-lora"} <= set(CPU_RECIPES)


@pytest.mark.slow  # a whole training run per recipe
@pytest.mark.parametrize("recipe, extra", [(r, "") for r in CPU_RECIPES] + [("tiny-cpu-lora",
                                                                             " train.compile_layers=false")])
def test_a_shipped_cpu_recipe_trains_and_writes_every_listed_output(tmp_path, recipe, extra):
    """As shipped (compiled layers on CPU), and LoRA op by op too (its dropout drawn in the forward)."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL_DIR", "DATA", "OVERRIDES", "RECIPE")}
    r = subprocess.run(["make", "--no-print-directory", "train", f"RECIPE={recipe}", f"OUTPUT_DIR={out}",
                        f"OVERRIDES={SHORT}{extra}"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                       timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lora = "lora" in recipe
    want = [rel.split("/")[0] for attr, rel, _ in ENTRIES if attr not in ELSEWHERE and (lora or attr != "adapter")]
    missing = [name for name in want if not (out / name).exists()]
    assert not missing, missing
    run = RunDir(out)
    assert (run.hf / "config.json").is_file() and (run.samples.read_text().count("\n") > 0)
    assert list(run.checkpoints.glob("step_*")) and "[train] done:" in r.stdout
