"""Env + CLI -> one dict of dotted recipe overrides -> validated Recipe (one parser for both).

Precedence: CLI ``key=value`` > environment (``OVERRIDES`` then the named variables) > recipe >
schema defaults. Empty environment values count as unset. Problems from the environment are
reported with the variable name, e.g. ``TP='two' (parallel.tp): expected an integer (e.g. TP=2)``.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from finetune.config import ConfigError, Recipe, load_recipe, parse_overrides

# Environment variable -> dotted recipe key (the env contract; see launcher/__main__.py).
ENV_KEYS: dict[str, str] = {
    "MODEL_DIR": "model.dir",
    "DATA": "data.paths",
    "DATA_FORMAT": "data.format",
    "OUTPUT_DIR": "output_dir",
    "NNODES": "launch.nnodes",
    "NODE_RANK": "launch.node_rank",
    "MASTER_ADDR": "launch.master_addr",
    "MASTER_PORT": "launch.master_port",
    "NPROC_PER_NODE": "launch.nproc_per_node",
    "HOSTFILE": "launch.hostfile",
    "TP": "parallel.tp",
    "PP": "parallel.pp",
    "DP": "parallel.dp",
    "NUMA_BIND": "launch.numa_bind",
    "MAX_RESTARTS": "launch.max_restarts",
    "DRY_RUN": "launch.dry_run",
}
NPU_RECIPE = "qwen2.5-7b-full"
CPU_RECIPE = "tiny-cpu"


def env_value(env: Mapping[str, str], name: str) -> str | None:
    """The variable's value, or None when unset or empty (empty counts as unset)."""
    v = env.get(name)
    return v if v not in (None, "") and v.strip() != "" else None


@dataclass
class Settings:
    """Everything the user asked for, before the recipe is loaded."""

    recipe: str
    recipe_reason: str
    overrides: dict[str, str] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)  # dotted key -> "TP" / "OVERRIDES" / "cli"
    problems: list[str] = field(default_factory=list)


def default_recipe(env: Mapping[str, str], has_npu: bool) -> tuple[str, str]:
    """RECIPE, else the NPU recipe when NPUs are present and MODEL_DIR and DATA are set, else tiny-cpu."""
    if env_value(env, "RECIPE"):
        return env["RECIPE"].strip(), "RECIPE is set"
    if has_npu and env_value(env, "MODEL_DIR") and env_value(env, "DATA"):
        return NPU_RECIPE, "NPUs present and MODEL_DIR and DATA set"
    if has_npu:
        return CPU_RECIPE, "NPUs present but MODEL_DIR or DATA unset: the embedded default (tiny-cpu)"
    return CPU_RECIPE, "no NPU found: the embedded default runs on CPU workers"


def collect(env: Mapping[str, str], cli_items: list[str], cli_recipe: str | None = None,
            has_npu: bool = False) -> Settings:
    """Merge env vars, ``OVERRIDES`` and CLI ``key=value`` items into dotted overrides."""
    name, reason = (cli_recipe, "--recipe given") if cli_recipe else default_recipe(env, has_npu)
    s = Settings(recipe=name, recipe_reason=reason)
    for var, key in ENV_KEYS.items():
        v = env_value(env, var)
        if v is not None:
            s.overrides[key] = v.strip()
            s.origin[key] = var
    env_items = (env_value(env, "OVERRIDES") or "").split()
    flat, probs = parse_overrides(env_items)
    s.problems += [f"OVERRIDES: {p}" for p in probs]
    for k, v in flat.items():
        s.overrides[k] = v
        s.origin[k] = "OVERRIDES"
    flat, probs = parse_overrides(cli_items)
    s.problems += probs
    for k, v in flat.items():  # the CLI also takes the variable names: `train TP=2 DATA=a.json`
        key = ENV_KEYS.get(k, k)
        s.overrides[key] = v
        s.origin[key] = k if k in ENV_KEYS else "cli"
    return s


def _rename(problem: str, settings: Settings) -> str:
    """Rewrite a schema problem about a key that came from an env var to name that variable."""
    m = re.match(r"([\w.]+)(\[\d+\])?[:=]", problem)
    if not m or settings.origin.get(m.group(1), "cli") == "cli":
        return problem
    if settings.origin[m.group(1)] == "OVERRIDES":
        return f"OVERRIDES: {problem}"
    key, var = m.group(1), settings.origin[m.group(1)]
    rest = problem[m.end():].lstrip()
    if problem[m.end() - 1] == "=":  # "key=value: must be ..." -> drop the repeated value
        rest = rest.split(": ", 1)[-1]
    rest = re.sub(r",? ?got [^(]*", " ", rest).strip()
    rest = re.sub(rf"\(e\.g\. {re.escape(key)}=([^)]*)\)", rf"(e.g. {var}=\1)", rest)
    return f"{var}={settings.overrides[key]!r} ({key}): {rest}"


def _first_per_key(problems: list[str]) -> list[str]:
    """Keep one problem per key: a value that failed to parse also fails the range checks."""
    seen, out = set(), []
    for p in problems:
        m = re.search(r"\(([\w.]+)\)|^(?:OVERRIDES: )?([\w.]+)[:=\[]", p)
        key = (m.group(1) or m.group(2)) if m else p
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def load(settings: Settings, extra: dict[str, str] | None = None) -> Recipe:
    """Load and validate the recipe; raise ConfigError naming env vars / keys with fixes.

    ``extra`` holds lower-precedence values (e.g. the detected cluster) that the user did not set.
    """
    overrides = {**(extra or {}), **settings.overrides}
    problems = list(settings.problems)
    try:
        recipe = load_recipe(settings.recipe, overrides)
    except ConfigError as e:
        raise ConfigError(problems + _first_per_key([_rename(p, settings) for p in e.problems])) from None
    if problems:
        raise ConfigError(problems)
    return recipe
