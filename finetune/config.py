"""The recipe schema: typed dataclasses that are the one source of defaults.

Pure Python (no mindspore import) so the launcher can validate recipes in milliseconds.
A recipe is YAML whose sections mirror these dataclasses; ``key=value`` overrides use
dotted paths (``train.lr=1e-5``). Unknown keys and bad values are collected, never
asserted, and reported all at once by :class:`ConfigError`, each naming the key and a fix.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
RECIPES_DIR = REPO_ROOT / "recipes"
ASSETS_DIR = REPO_ROOT / "assets"


class ConfigError(ValueError):
    """Every problem found in a recipe, each line naming the key and a fix."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in self.problems))


@dataclass
class ModelConfig:
    """Where the Hugging Face model lives (MODEL_DIR), or how to create the tiny default."""

    dir: str = ""  # HF layout: config.json, *.safetensors (+ index), tokenizer.json
    # When set and `dir` holds no config.json: create a seeded random-init Qwen2 model there,
    # with these config.json fields over a tiny default, and the bundled Qwen2.5 tokenizer.
    init: dict | None = None
    init_seed: int = 0


@dataclass
class CleanConfig:
    """Rule-based cleaning applied by prepare-data; each rule switchable and counted."""

    empty_response: bool = True
    repeat_prompt: bool = True
    repeated_chars: bool = True
    repeated_chars_max_run: int = 10  # a run of the same punctuation/char longer than this drops
    mojibake: bool = True
    mojibake_max_ratio: float = 0.3  # share of non-printable / U+FFFD characters that drops
    invalid_utf8: bool = True
    dedup: bool = True
    min_tokens: int = 4  # whole templated sample, in tokens
    max_tokens: int = 0  # 0: no upper bound beyond data.seq_len truncation


@dataclass
class DataConfig:
    """Instruction data (DATA, DATA_FORMAT) and how it becomes token batches."""

    paths: list[str] = field(default_factory=list)  # files or dirs; JSON, JSONL or Parquet
    format: str = "auto"  # auto | alpaca | sharegpt
    weights: list[float] = field(default_factory=list)  # one per path; empty: all 1.0
    seq_len: int = 1024
    packing: bool = True
    system_prompt: str = "You are a helpful assistant."
    max_tokens_per_batch: int = 0  # >0: dynamic batching by token budget instead of packing
    cache_dir: str = ""  # token cache; default <output_dir>/data
    shared_storage: bool = False  # True: one process per job prepares (output on shared FS)
    num_workers: int = 0  # tokenizer processes for prepare-data; 0: auto (from 8 MB of input one per CPU, at most 8)
    max_samples: int = 0  # 0: all
    worker_malloc: str = "auto"  # tokenizer processes' malloc: auto (the cmeel-mimalloc wheel, else a system tcmalloc/jemalloc/mimalloc) | system | path
    clean: CleanConfig = field(default_factory=CleanConfig)


@dataclass
class LossScaleConfig:
    """Dynamic loss scaling for train.precision=fp16."""

    initial: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


@dataclass
class TrainConfig:
    """Optimizer, schedule, batch and checkpoint settings (defaults from the field guide)."""

    lr: float = 2e-5
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-6
    weight_decay: float = 0.01
    warmup_steps: int = 0
    schedule: str = "cosine"  # cosine | constant
    min_lr: float = 0.0
    clip_grad: float = 1.0  # 0: no clipping
    grad_accum: int = 1
    micro_batch_size: int = 1
    epochs: int = 1
    max_steps: int = 0  # 0: derived from epochs
    recompute: bool = False  # per-layer activation recompute
    loss_chunk_tokens: int = 1024  # LM head + cross-entropy over chunks of this many label tokens (0: all at once)
    precision: str = "auto"  # auto (fp32 on CPU, bf16 on Ascend) | fp32 | bf16 | fp16
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    seed: int = 42
    log_every: int = 1
    save_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 2
    resume: str = "auto"  # auto | never | <checkpoint dir>
    tensorboard: bool = True  # scalar event files under <output_dir>/tensorboard (rank 0)


@dataclass
class ParallelConfig:
    """Layout: world = tp x dp x pp. dp=0 derives it from the world size."""

    tp: int = 1
    dp: int = 0
    pp: int = 1
    shard_optimizer: bool | None = None  # None: on when dp > 1
    vocab_parallel: bool = True  # tp > 1: embedding/LM head split by vocab rows, parallel cross-entropy


@dataclass
class ExportConfig:
    """Hugging Face export written to <output_dir>/hf at the end."""

    enabled: bool = True
    dtype: str = "bf16"  # bf16 | fp16 | fp32
    shard_size: str = "2GB"


@dataclass
class LaunchConfig:
    """Host-side topology and supervision (filled by the launcher from env/CLI)."""

    device: str = "auto"  # auto | npu | cpu
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 8118
    nproc_per_node: int = 0  # 0: visible NPU count (CPU: 1)
    hostfile: str = ""
    numa_bind: str = "auto"  # auto | numactl | affinity | off
    max_restarts: int = 0
    cluster_time_out: int = 600
    dry_run: bool = False


@dataclass
class Recipe:
    """A whole job: the YAML recipe resolved with env and CLI overrides."""

    name: str = ""
    output_dir: str = "./output"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)


# ---------------------------------------------------------------------------- parsing

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _example(tp: Any) -> str:
    return {int: "8", float: "2e-5", bool: "true", str: "text"}.get(tp, "[...]")


def _coerce(value: Any, tp: Any, key: str, problems: list[str]) -> Any:
    """Convert a YAML value or an override string to the annotated type."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union or (origin is not None and type(None) in args):
        inner = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in {"", "null", "none", "auto"}):
            return None
        return _coerce(value, inner[0], key, problems)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append(f"{key}: expected a mapping of settings, got {value!r}")
            return tp()
        return _build(tp, value, key + ".", problems)
    if tp is dict or origin is dict:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass
        if not isinstance(value, dict):
            problems.append(f"{key}: expected a mapping, got {value!r} (e.g. {key}='{{\"hidden_size\": 64}}')")
            return None
        return value
    if origin is list:
        if isinstance(value, str):
            value = [v for v in (value.split(",") if value else [])]
        if not isinstance(value, (list, tuple)):
            problems.append(f"{key}: expected a list, got {value!r} (e.g. {key}=a,b)")
            return []
        return [_coerce(v, args[0] if args else str, f"{key}[{i}]", problems) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if str(value).strip().lower() in _TRUE:
            return True
        if str(value).strip().lower() in _FALSE:
            return False
        problems.append(f"{key}: expected true or false, got {value!r} (e.g. {key}=true)")
        return False
    if tp in (int, float):
        if isinstance(value, bool):
            problems.append(f"{key}: expected a number, got {value!r} (e.g. {key}={_example(tp)})")
            return tp()
        try:
            if tp is int:
                f = float(value)
                if f != int(f):
                    raise ValueError
                return int(f)
            return float(value)
        except (TypeError, ValueError):
            problems.append(f"{key}: expected {'an integer' if tp is int else 'a number'}, got {value!r} "
                            f"(e.g. {key}={_example(tp)})")
            return tp()
    if tp is str:
        if isinstance(value, (dict, list)):
            problems.append(f"{key}: expected text, got {value!r}")
            return ""
        return "" if value is None else str(value)
    return value


def _build(cls: type, raw: dict, prefix: str, problems: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in raw.items():
        if k not in hints:
            close = difflib.get_close_matches(str(k), names, n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; known keys: {', '.join(names)}"
            problems.append(f"{prefix}{k}: unknown key{hint}")
            continue
        kwargs[k] = _coerce(v, hints[k], prefix + k, problems)
    return cls(**kwargs)


def _nest(flat: dict[str, Any]) -> dict:
    out: dict = {}
    for dotted, v in flat.items():
        d = out
        parts = dotted.split(".")
        for p in parts[:-1]:
            d = d.setdefault(p, {})
            if not isinstance(d, dict):
                break
        else:
            d[parts[-1]] = v
    return out


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "init":
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_overrides(items: list[str]) -> tuple[dict[str, str], list[str]]:
    """``["train.lr=1e-5", ...]`` -> ``{"train.lr": "1e-5"}`` plus problems for malformed items."""
    flat, problems = {}, []
    for item in items:
        if "=" not in item or item.startswith("="):
            problems.append(f"override {item!r}: expected key=value (e.g. train.lr=1e-5)")
            continue
        k, v = item.split("=", 1)
        flat[k.strip()] = v
    return flat, problems


def resolve_recipe_path(name_or_path: str) -> Path:
    """A recipe name in recipes/ (with or without .yaml) or a path to a YAML file."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    for cand in (RECIPES_DIR / f"{name_or_path}.yaml", RECIPES_DIR / name_or_path, p):
        if cand.is_file():
            return cand
    known = ", ".join(sorted(x.stem for x in RECIPES_DIR.glob("*.yaml")))
    raise ConfigError([f"RECIPE={name_or_path!r}: no such recipe; use one of: {known}, or a path to a YAML file"])


def load_recipe(name_or_path: str | None = None, overrides: dict[str, Any] | None = None,
                raw: dict | None = None) -> Recipe:
    """Recipe YAML (or ``raw``) + dotted overrides -> validated :class:`Recipe`.

    Raises :class:`ConfigError` listing every problem at once.
    """
    problems: list[str] = []
    data: dict = {}
    if raw is not None:
        data = raw
    elif name_or_path:
        path = resolve_recipe_path(name_or_path)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError([f"{path}: not valid YAML: {e}"]) from None
        if not isinstance(data, dict):
            raise ConfigError([f"{path}: a recipe is a mapping of sections (model:, data:, train:, ...)"])
        data.setdefault("name", path.stem)
    data = _merge(data, _nest(overrides or {}))
    recipe = _build(Recipe, data, "", problems)
    problems += validate(recipe)
    if problems:
        raise ConfigError(problems)
    return recipe


def _choice(problems: list[str], key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        problems.append(f"{key}={value!r}: must be one of {', '.join(allowed)} (e.g. {key}={allowed[0]})")


def parse_size(text: str) -> int:
    """'2GB' / '500MB' / '1024' -> bytes (decimal units, like Hugging Face's max_shard_size)."""
    t = str(text).strip().upper().replace(" ", "")
    units = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3, "TIB": 2**40, "GIB": 2**30,
             "MIB": 2**20, "KIB": 2**10, "B": 1}
    for u, m in units.items():
        if t.endswith(u) and t[: -len(u)]:
            return int(float(t[: -len(u)]) * m)
    return int(t)


def validate(r: Recipe) -> list[str]:
    """Cross-field checks that the types alone do not catch."""
    p: list[str] = []
    _choice(p, "data.format", r.data.format, ("auto", "alpaca", "sharegpt"))
    _choice(p, "train.schedule", r.train.schedule, ("cosine", "constant"))
    _choice(p, "train.precision", r.train.precision, ("auto", "fp32", "bf16", "fp16"))
    _choice(p, "export.dtype", r.export.dtype, ("bf16", "fp16", "fp32"))
    _choice(p, "launch.device", r.launch.device, ("auto", "npu", "cpu"))
    _choice(p, "launch.numa_bind", r.launch.numa_bind, ("auto", "numactl", "affinity", "off"))
    for key, v, lo in (("data.seq_len", r.data.seq_len, 8), ("train.grad_accum", r.train.grad_accum, 1),
                       ("train.micro_batch_size", r.train.micro_batch_size, 1),
                       ("train.epochs", r.train.epochs, 1), ("train.log_every", r.train.log_every, 1),
                       ("parallel.tp", r.parallel.tp, 1), ("parallel.pp", r.parallel.pp, 1),
                       ("launch.nnodes", r.launch.nnodes, 1)):
        if v < lo:
            p.append(f"{key}={v}: must be >= {lo} (e.g. {key}={max(lo, 1)})")
    for key, v in (("train.max_steps", r.train.max_steps), ("train.warmup_steps", r.train.warmup_steps),
                   ("train.save_every", r.train.save_every), ("parallel.dp", r.parallel.dp),
                   ("launch.max_restarts", r.launch.max_restarts), ("launch.node_rank", r.launch.node_rank),
                   ("data.max_tokens_per_batch", r.data.max_tokens_per_batch),
                   ("train.loss_chunk_tokens", r.train.loss_chunk_tokens)):
        if v < 0:
            p.append(f"{key}={v}: must be >= 0 (e.g. {key}=0)")
    if not (r.train.lr > 0):
        p.append(f"train.lr={r.train.lr}: must be > 0 (e.g. train.lr=2e-5)")
    if len(r.train.betas) != 2 or not all(0 <= b < 1 for b in r.train.betas):
        p.append(f"train.betas={r.train.betas}: two numbers in [0, 1) (e.g. train.betas=0.9,0.999)")
    if r.parallel.pp != 1:
        p.append(f"parallel.pp={r.parallel.pp}: pipeline parallelism is not supported yet; "
                 "use parallel.pp=1 with tensor parallelism (parallel.tp=2) instead")
    c = r.data.clean
    for key, v in (("data.num_workers", r.data.num_workers), ("data.max_samples", r.data.max_samples),
                   ("data.clean.min_tokens", c.min_tokens), ("data.clean.max_tokens", c.max_tokens)):
        if v < 0:
            p.append(f"{key}={v}: must be >= 0 (e.g. {key}=0)")
    wm = r.data.worker_malloc
    if wm not in ("auto", "system") and not (wm.startswith("/") and ".so" in wm):
        p.append(f"data.worker_malloc={wm!r}: auto, system or the absolute path of a malloc library "
                 "(e.g. data.worker_malloc=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4)")
    if c.repeated_chars_max_run < 1:
        p.append(f"data.clean.repeated_chars_max_run={c.repeated_chars_max_run}: must be >= 1 "
                 "(e.g. data.clean.repeated_chars_max_run=10)")
    if not 0 < c.mojibake_max_ratio <= 1:
        p.append(f"data.clean.mojibake_max_ratio={c.mojibake_max_ratio}: a share in (0, 1] "
                 "(e.g. data.clean.mojibake_max_ratio=0.3)")
    if any(w < 0 for w in r.data.weights):
        p.append(f"data.weights={r.data.weights}: weights are >= 0 (e.g. data.weights=1,0.5)")
    if r.data.weights and len(r.data.weights) != len(r.data.paths):
        p.append(f"data.weights: {len(r.data.weights)} weights for {len(r.data.paths)} paths; "
                 "give one weight per data.paths entry or none")
    if not 1 <= r.launch.master_port <= 65535:
        p.append(f"launch.master_port={r.launch.master_port}: a TCP port 1..65535 (e.g. 8118)")
    if r.launch.node_rank >= r.launch.nnodes and not r.launch.hostfile:
        p.append(f"launch.node_rank={r.launch.node_rank}: must be < launch.nnodes={r.launch.nnodes}")
    try:
        if parse_size(r.export.shard_size) <= 0:
            raise ValueError
    except ValueError:
        p.append(f"export.shard_size={r.export.shard_size!r}: a size like 2GB or 500MB")
    return p


def resolved_model_dir(r: Recipe) -> str:
    """model.dir, or <output_dir>/base-model for the created tiny default (model.init set)."""
    if r.model.dir:
        return r.model.dir
    return str(Path(r.output_dir) / "base-model") if r.model.init is not None else ""


def to_dict(r: Any) -> dict:
    return dataclasses.asdict(r)


def from_dict(d: dict) -> Recipe:
    """Rebuild a Recipe from :func:`to_dict` output (e.g. the resolved recipe in plan.json)."""
    return load_recipe(raw=d)
