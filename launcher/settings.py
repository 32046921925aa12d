"""Env + CLI -> one dict of dotted recipe overrides -> validated Recipe (one parser for both).

Precedence: CLI ``key=value`` > environment (``OVERRIDES`` then the named variables) > recipe >
schema defaults. Empty environment values count as unset. A problem names where its value came
from: ``PP='two' (parallel.pp): expected an integer (e.g. PP=8)`` for a variable,
``OVERRIDES: train.lr='x': ...`` for an ``OVERRIDES`` item, ``recipes/x.yaml:12: ...`` for a recipe line.
"""
from __future__ import annotations

import errno
import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from jobspec.config import ConfigError, Problem, Recipe, overridden, parse_overrides
from jobspec.keys import env_keys, path_keys
from jobspec.recipe_load import load_recipe

# HCCL variables: defaults the launcher sets when unset (CANN's are 120 s connect and 1836 s exec on Atlas A2,
# CANN env var reference; the connect wait is raised for multi-node start-up, the exec wait never set below
# CANN's), and those passed through unchanged. Workers get all of them; render passes them to the pods.
HCCL_DEFAULTS = {"HCCL_CONNECT_TIMEOUT": "1200", "HCCL_EXEC_TIMEOUT": "1836"}
HCCL_PASSTHROUGH = ("HCCL_IF_IP", "HCCL_SOCKET_IFNAME", "HCCL_BUFFSIZE")
HCCL_VARS = (*HCCL_DEFAULTS, *HCCL_PASSTHROUGH)
# CPU workers: glibc's malloc keeps freed small blocks (no trim), and maps each block of 1 MiB or more on its own
# (a fixed threshold: no dynamic rise), returned when freed. The numpy arrays of the LM head (logits, weight
# gradient) and of a checkpoint's copies then leave no freed heap behind that a later, larger one does not fit in:
# with every block on the heap (MALLOC_MMAP_MAX_=0 before) the step-1 peak RSS was up to 0.6 GiB above the live
# bytes (docs/memory.md, "glibc"); the cost is fresh zeroed pages for those arrays each step (docs/speed.md).
CPU_MALLOC_DEFAULTS = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}

# The env contract, the one table: (variable, recipe key or "", meaning). The rows of recipe keys come from the
# keys' facts (jobspec/keys.py: ``env``, ``env_help``), in the schema's order. docs/environment.md's table is generated
# from it (env_table); tests/launcher/test_env_settings.py keeps them equal.
ENV_CONTRACT: tuple[tuple[str, str, str], ...] = (
    ("RECIPE", "", "name in `recipes/` or a YAML path; default `qwen2.5-7b-full` when NPUs are present and "
                   "`MODEL_DIR` and `DATA` are set, else `tiny-cpu`"),
    *((var, key, meaning) for var, (key, meaning) in env_keys(Recipe()).items()),
    ("OVERRIDES", "", "space-separated `key=value` for any recipe key, e.g. "
                      "`OVERRIDES=\"train.lr=1e-5 train.epochs=1\"`; a value with spaces in quotes after the `=` "
                      "(`OVERRIDES='data.system_prompt=\"You are a pirate\"'`), `key=\"\"` the empty value"),
    (", ".join(HCCL_DEFAULTS), "", f"defaulted for workers to {' / '.join(HCCL_DEFAULTS.values())} s (CANN's A2 "
                                   "default) when unset"),
    (", ".join(HCCL_PASSTHROUGH), "", "passed through to workers unchanged"),
    (", ".join(CPU_MALLOC_DEFAULTS), "", "defaulted for CPU workers to " + " / ".join(CPU_MALLOC_DEFAULTS.values())
     + " when unset: glibc maps blocks of 1 MiB or more on their own and returns them when freed, and keeps "
     "freed smaller ones"),
    ("ASCEND_VISIBLE_DEVICES", "", "physical NPU ids (`0-3`, `0,2,4`, or ascend-operator's `Ascend910-0,Ascend910-1`) "
                                   "to use; read"),
    ("ASCEND_RT_VISIBLE_DEVICES", "", "logical NPU ids; read, and set for workers when only some NPUs are used"),
)
# Recipe keys that hold paths: key -> (input | output, an example under a data dir), from the keys' facts.
# absolutize makes them absolute for the workers; render checks that each is a pod path.
PATH_KEYS: dict[str, tuple[str, str]] = path_keys(Recipe())
# Environment variable -> dotted recipe key.
ENV_KEYS: dict[str, str] = {var: key for var, key, _ in ENV_CONTRACT if key}
NPU_RECIPE = "qwen2.5-7b-full"
CPU_RECIPE = "tiny-cpu"


def env_table() -> str:
    """The env contract as docs/environment.md's Markdown table."""
    rows = ["| variable | recipe key | meaning / default |", "|---|---|---|"]
    for var, key, meaning in ENV_CONTRACT:
        names = ", ".join(f"`{v.strip()}`" for v in var.split(","))
        rows.append(f"| {names} | {f'`{key}`' if key else '–'} | {meaning} |")
    return "\n".join(rows)


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

    def render(self, p: Problem) -> str:
        """A problem worded by where its value came from: the variable, OVERRIDES or the command line."""
        key = overridden(p.key, self.overrides) if p.key else None
        via = self.origin.get(key or "", "")
        if via == "OVERRIDES":
            return f"OVERRIDES: {p.text()}"
        if via and via != "cli" and key == p.key:
            return p.text(via, self.overrides[key])
        return p.text()

    def origin_of(self, key: str) -> str:
        """``OUTPUT_DIR`` / ``OVERRIDES`` / ``the command line`` / ``the recipe`` for a dotted key."""
        via = self.origin.get(key, "")
        return {"": f"the recipe {self.recipe}", "cli": "the command line"}.get(via, via)


def default_recipe(recipe_var: str | None, overrides: Mapping[str, str], has_npu: bool) -> tuple[str, str]:
    """RECIPE, else the NPU recipe when NPUs are present and a model dir and data are given (MODEL_DIR and
    DATA, or model.dir and data.paths in OVERRIDES or on the command line), else tiny-cpu."""
    if recipe_var:
        return recipe_var.strip(), "RECIPE is set"
    given = {"model.dir", "data.paths"} <= {k for k, v in overrides.items() if v.strip()}
    if has_npu and given:
        return NPU_RECIPE, "NPUs present and MODEL_DIR and DATA set"
    if has_npu:
        return CPU_RECIPE, "NPUs present but MODEL_DIR or DATA unset: the embedded default (tiny-cpu)"
    return CPU_RECIPE, "no NPU found: the embedded default runs on CPU workers"


_ITEM = re.compile(r"""([^\s=]+=)(?:"([^"]*)"|'([^']*)')(?=\s|$)|\S+""")


def split_overrides(text: str) -> tuple[list[str], list[str]]:
    """``OVERRIDES`` -> its ``key=value`` items, split at spaces; a value in quotes may hold spaces
    (``data.system_prompt="You are a pirate"``) and ``key=""`` is the empty value. Quotes inside a value
    stay (``data.columns={"instruction":"prompt"}``). (items, problems)"""
    items, problems = [], []
    for m in _ITEM.finditer(text):
        if m.group(1):
            items.append(m.group(1) + (m.group(2) if m.group(2) is not None else m.group(3)))
            continue
        item = m.group(0)
        value = item.split("=", 1)[1] if "=" in item else ""
        if value[:1] in ("'", '"') and not (len(value) > 1 and value.endswith(value[0])):
            problems.append(f"OVERRIDES={text!r}: the quote after {item.split('=', 1)[0]}= is not closed; quote a "
                            "value with spaces as a whole, e.g. OVERRIDES='data.system_prompt=\"You are a pirate\" "
                            "train.lr=1e-5'")
            return [], problems
        items.append(item)
    return items, problems


def join_overrides(flat: Mapping[str, str]) -> str:
    """The ``OVERRIDES`` text that :func:`split_overrides` reads back as ``flat``."""
    def one(k: str, v: str) -> str:
        if v and not any(c.isspace() for c in v):
            return f"{k}={v}"
        return f"{k}='{v}'" if '"' in v else f'{k}="{v}"'
    return " ".join(one(k, v) for k, v in flat.items())


def collect(env: Mapping[str, str], cli_items: list[str], cli_recipe: str | None = None,
            has_npu: bool = False) -> Settings:
    """Merge env vars, ``OVERRIDES`` and CLI ``key=value`` items into dotted overrides.

    The CLI also takes the variable names (``train TP=2 DATA=a.json RECIPE=tiny-cpu``).
    """
    cli_vars = dict(i.split("=", 1) for i in cli_items if i.split("=", 1)[0] in ("RECIPE", *ENV_KEYS) and "=" in i)
    rest = [i for i in cli_items if i.split("=", 1)[0] not in cli_vars]
    s = Settings(recipe="", recipe_reason="")
    for var, key in ENV_KEYS.items():
        v = env_value(env, var)
        if v is not None:
            s.overrides[key], s.origin[key] = v.strip(), var
    items, quoting = split_overrides(env_value(env, "OVERRIDES") or "")
    flat, probs = parse_overrides(items)
    s.problems += [f"OVERRIDES: {p.text()}" for p in probs] + quoting
    s.overrides.update(flat)
    s.origin.update(dict.fromkeys(flat, "OVERRIDES"))
    flat, probs = parse_overrides(rest)
    s.problems += [p.text() for p in probs]
    s.overrides.update(flat)
    s.origin.update(dict.fromkeys(flat, "cli"))
    for var, v in cli_vars.items():
        if var in ENV_KEYS:
            s.overrides[ENV_KEYS[var]], s.origin[ENV_KEYS[var]] = v, var
    s.recipe, s.recipe_reason = (cli_recipe, "--recipe given") if cli_recipe else \
        default_recipe(cli_vars.get("RECIPE") or env_value(env, "RECIPE"), s.overrides, has_npu)
    if s.overrides.get("launch.nproc_per_node", "").strip() == "0":  # the schema's 0 means "not given"
        via = s.origin["launch.nproc_per_node"]
        name = {"OVERRIDES": "OVERRIDES: launch.nproc_per_node", "cli": "launch.nproc_per_node"}.get(via, via)
        s.problems.append(f"{name}=0: no workers; leave it unset for one worker per visible NPU (1 without NPUs), "
                          "or give a count (e.g. NPROC_PER_NODE=8)")
    return s


def load(settings: Settings, extra: dict[str, str] | None = None) -> Recipe:
    """Load and validate the recipe; raise ConfigError naming env vars / keys with fixes.

    ``extra`` holds lower-precedence values (e.g. the detected cluster) that the user did not set.
    Data the user gives (``DATA``, ``data.paths``) is read with ``data.format=auto`` unless a format is set.
    """
    overrides = {**(extra or {}), **settings.overrides}
    if "data.paths" in overrides and "data.format" not in overrides:  # a recipe's format is for its own paths
        overrides["data.format"] = "auto"
    try:
        recipe = load_recipe(settings.recipe, overrides, render=settings.render)
    except ConfigError as e:
        raise ConfigError([*settings.problems, *e.items], settings.render) from None
    if settings.problems:
        raise ConfigError(settings.problems)
    loops = [p for key in PATH_KEYS for p in _loop_problems(recipe, key)]
    if loops:
        raise ConfigError(loops, settings.render)
    return recipe


def _loop_problems(recipe: Recipe, key: str) -> list[Problem]:
    """A path of ``key`` that is a symlink loop (it cannot be resolved; the workers get absolute paths)."""
    *parents, leaf = key.split(".")
    value = getattr(functools.reduce(getattr, parents, recipe), leaf)
    out = []
    for path in value if isinstance(value, list) else [value] if value else []:
        try:
            Path(path).expanduser().resolve()
        except (RuntimeError, OSError) as e:  # Python 3.11: RuntimeError("Symlink loop from ...")
            if isinstance(e, OSError) and e.errno != errno.ELOOP:
                raise
            out.append(Problem(key, f"{path} is a symlink loop ({e}); point it at the real file or directory "
                                    "(ls -l shows where each link points)", f"/data/{PATH_KEYS[key][1]}",
                               repr(",".join(value) if isinstance(value, list) else value)))
    return out
