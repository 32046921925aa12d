"""A recipe's values checked before any work: each key's range from its facts (jobspec/keys.py) and the
cross-field rules that the types alone do not catch (floats are finite already). Pure Python."""
from __future__ import annotations

from jobspec.config import Problem, Recipe, compile_layers_problems, parse_size
from jobspec.eval_config import eval_problems
from jobspec.input_checks import input_problems
from jobspec.keys import range_problems
from jobspec.lora_config import lora_problems


def validate(r: Recipe) -> list[Problem]:
    """Every problem of ``r``: ranges (the eval section checks its own, ``eval_problems``), then the rules."""
    t, L = r.train, r.launch
    p = compile_layers_problems(r) + lora_problems(r.lora) + input_problems(r.data, t.method, r.lora)
    p += eval_problems(r.eval) + range_problems(r, skip=("eval",))
    if t.profile_steps and not (len(t.profile_steps) == 2 and 1 <= t.profile_steps[0] <= t.profile_steps[1]):
        p.append(Problem("train.profile_steps", "two steps [start, end], 1 <= start <= end", "3,5",
                         repr(t.profile_steps)))
    if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
        p.append(Problem("train.betas", "two numbers in [0, 1)", "0.9,0.999", repr(t.betas)))
    if r.parallel.pp != 1:
        p.append(Problem("parallel.pp", "pipeline parallelism is not supported yet; use parallel.pp=1 with "
                                        "tensor parallelism (parallel.tp=2) instead", "1", repr(r.parallel.pp)))
    wm = r.data.worker_malloc
    if wm not in ("auto", "system") and not (wm.startswith("/") and ".so" in wm):
        p.append(Problem("data.worker_malloc", "auto, system or the absolute path of a malloc library",
                         "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", repr(wm)))
    if any(w < 0 for w in r.data.weights):
        p.append(Problem("data.weights", "weights are >= 0", "1,0.5", repr(r.data.weights)))
    if r.data.weights and len(r.data.weights) != len(r.data.paths):
        p.append(Problem("data.weights", f"{len(r.data.weights)} weights for {len(r.data.paths)} paths; "
                                         "give one weight per data.paths entry or none"))
    if L.node_rank >= L.nnodes and not L.hostfile:
        p.append(Problem("launch.node_rank", f"must be < launch.nnodes={L.nnodes}", "0", repr(L.node_rank)))
    try:
        if parse_size(r.export.shard_size) <= 0:
            raise ValueError
    except (ValueError, OverflowError):
        p.append(Problem("export.shard_size", "a size like 2GB or 500MB", "2GB", repr(r.export.shard_size)))
    return p
