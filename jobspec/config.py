"""The recipe schema: typed dataclasses that are the one source of defaults.

Pure Python (no mindspore import) so the launcher can validate recipes in milliseconds. A recipe is
YAML whose sections mirror these dataclasses; ``key=value`` overrides use dotted paths (``train.lr=1e-5``).
Unknown keys and bad values are collected, never asserted, and reported all at once by :class:`ConfigError`.
Reading YAML and overrides and coercing values to these types: ``jobspec/recipe_parse.py``.
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

# ConfigError, Problem, overridden, parse_overrides and parse_size are imported from here across the project
from jobspec.eval_config import EvalConfig, eval_problems
from jobspec.input_checks import input_problems
from jobspec.layout import (
    Device,
    Layout,
    LayoutRequest,
    decide,
    host_collectives_problems,
    world_problems,
    zero_problems,
)
from jobspec.lora_config import LoraConfig, lora_problems
from jobspec.recipe_parse import ConfigError as ConfigError
from jobspec.recipe_parse import Problem as Problem
from jobspec.recipe_parse import build, merge, nest, read_recipe
from jobspec.recipe_parse import overridden as overridden
from jobspec.recipe_parse import parse_overrides as parse_overrides
from jobspec.recipe_parse import parse_size as parse_size
from jobspec.rundir import run_dir_of

REPO_ROOT = Path(__file__).resolve().parent.parent
RECIPES_DIR = REPO_ROOT / "recipes"
ASSETS_DIR = REPO_ROOT / "assets"
# Mappings an override replaces whole instead of key by key (model.init: the tiny model's config.json fields)
WHOLE_KEYS = frozenset({"model.init"})


@dataclass
class ModelConfig:
    """Where the Hugging Face model lives (MODEL_DIR), or how to create the tiny default."""

    dir: str = ""  # HF layout: config.json, *.safetensors (+ index), tokenizer.json
    # When set and `dir` holds no config.json: create a seeded random-init Qwen2 model there,
    # with these config.json fields over a tiny default, and the bundled Qwen2.5 tokenizer.
    init: dict[str, Any] | None = None
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
    format: Literal["auto", "alpaca", "sharegpt", "text"] = "auto"
    # the formats' field names -> this dataset's own, e.g. {"instruction": "question", "output": "answer"}
    columns: dict[str, str] = field(default_factory=dict)
    on_error: Literal["fail", "skip"] = "fail"  # skip: malformed records are dropped and counted in the report
    val_size: float = 0.0  # held out for validation: a fraction (< 1) or a count (>= 1) of the samples
    val_paths: list[str] = field(default_factory=list)  # validation files (instead of val_size)
    weights: list[float] = field(default_factory=list)  # one per path; empty: all 1.0
    seq_len: int = 1024
    packing: bool = True
    system_prompt: str = "You are a helpful assistant."
    # reasoning (reasoning_content, or <think>...</think> opening an answer); auto: keep what the data has
    thinking: Literal["auto", "keep", "drop"] = "auto"
    max_tokens_per_batch: int = 0  # >0: dynamic batching by token budget instead of packing
    cache_dir: str = ""  # token cache; default <output_dir>/data
    shared_storage: bool = False  # True: one process per job prepares (output on shared FS)
    num_workers: int = 0  # tokenizer processes for prepare-data; 0: auto (from 8 MB of input one per CPU, at most 8)
    max_samples: int = 0  # 0: all
    # tokenizer processes' malloc: auto (the cmeel-mimalloc wheel, else a system tcmalloc/jemalloc/mimalloc)
    # | system | path
    worker_malloc: str = "auto"
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

    method: Literal["full", "lora"] = "full"  # lora: adapters on the frozen base (the lora section)
    lr: float = 2e-5
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-6
    weight_decay: float = 0.01
    warmup_steps: int = 0
    schedule: Literal["cosine", "constant"] = "cosine"
    min_lr: float = 0.0
    clip_grad: float = 1.0  # 0: no clipping
    grad_accum: int = 1
    micro_batch_size: int = 1
    epochs: int = 1
    max_steps: int = 0  # 0: derived from epochs
    recompute: bool = False  # per-layer activation recompute
    # each decoder layer as one mindspore.jit graph (docs/speed.md); unset (auto): on wherever
    # compile_layers_refusals finds no reason against it (on CPU: DP, ZeRO and fp16 included)
    compile_layers: bool | None = None
    loss_chunk_tokens: int = 1024  # LM head + cross-entropy over chunks of this many label tokens (0: all at once)
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: fp32 on CPU, bf16 on Ascend
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    seed: int = 42
    log_every: int = 1
    save_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 2  # 0: keep all
    resume: str = "auto"  # auto | never | <checkpoint dir>
    tensorboard: bool = True  # scalar event files under <output_dir>/tensorboard (rank 0)
    # Stop after this many consecutive steps with a non-finite loss or gradients. fp16's dynamic loss
    # scale skips a step per backoff (65536 -> 1 takes 16); bf16/fp32 have no scale to lower.
    max_bad_steps: int = 20
    eval_every: int = 0  # eval loss on the validation set (data.val_size / data.val_paths) every N steps; 0: at the end
    early_stop_patience: int = 0  # stop after this many evaluations without a better eval loss; 0: never
    profile_steps: list[int] = field(default_factory=list)  # [start, end]: profile these steps on rank 0

    def precision_on(self, device: str) -> Literal["fp32", "bf16", "fp16"]:
        """The concrete precision on ``device`` ('npu' | 'cpu'): auto is bf16 on NPU, fp32 on CPU."""
        if self.precision == "auto":
            return "bf16" if device == "npu" else "fp32"
        return self.precision

    def device_problems(self, device: str) -> list[Problem]:
        if self.precision_on(device) == "bf16" and device == "cpu":
            return [Problem("train.precision", "the CPU has no bf16 matmul; use fp32 (or fp16) on CPU, bf16 on "
                            "Ascend", "fp32", repr(self.precision))]
        return []


@dataclass
class ParallelConfig:
    """The layout asked for: world = tp x dp x pp (tp auto: the launcher's ``jobspec.layout_choice.auto_layout``).
    ``Recipe.resolved`` decides the rest into its ``layout``."""

    tp: int | Literal["auto"] = 1
    dp: int = 0
    pp: int = 1
    shard_optimizer: bool | None = None  # unset: on when dp > 1
    vocab_parallel: bool = True  # tp > 1: embedding/LM head split by vocab rows, parallel cross-entropy
    overlap_grad_reduce: bool = True  # dp > 1: each gradient bucket's reduction starts during the backward
    host_collectives: bool | None = None  # DP sums via /dev/shm (CPU, one node); unset: where jobspec.layout allows
    zero: int | Literal["auto"] = "auto"  # ZeRO stage over DP (jobspec.layout.zero_problems); auto: 1 when dp > 1

    @property
    def tp_size(self) -> int:  # 1 while tp is an unresolved "auto" (Recipe.resolved refuses it)
        return self.tp if isinstance(self.tp, int) else 1


@dataclass
class ExportConfig:
    """Hugging Face export written to <output_dir>/hf at the end."""

    enabled: bool = True
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    shard_size: str = "2GB"
    merge: bool = True  # train.method=lora: also write base + adapter merged to hf/ (adapter/ always)
    # answered after export into <output_dir>/samples.jsonl; "": no check
    check_prompts: str = "assets/prompts/check.jsonl"
    check_max_new_tokens: int = 64


@dataclass
class LaunchConfig:
    """Host-side topology and supervision (filled by the launcher from env/CLI)."""

    device: Literal["auto", "npu", "cpu"] = "auto"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 8118
    nproc_per_node: int = 0  # 0: visible NPU count (CPU: 1)
    hostfile: str = ""
    numa_bind: Literal["auto", "numactl", "affinity", "off"] = "auto"
    max_restarts: int = 0
    cluster_time_out: int = 600
    master_resolve_timeout_s: int = 600  # how long the launcher retries resolving MASTER_ADDR's name
    dry_run: bool = False
    npu_monitor_s: float = 30.0  # npu-smi sampling into OUTPUT_DIR/npu.jsonl while training; 0: off


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
    lora: LoraConfig = field(default_factory=LoraConfig)  # with train.method=lora
    eval: EvalConfig = field(default_factory=EvalConfig)  # make eval (jobspec/eval_config.py)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    layout: Layout | None = None  # decided by `resolved` (plan.json carries it); never set in a recipe

    @property
    def decided_layout(self) -> Layout:
        """The layout of a resolved recipe; ValueError on one not resolved yet."""
        if self.layout is None:
            raise ValueError("the recipe is not resolved: Recipe.resolved(world, device) decides its layout")
        return self.layout

    def resolved(self, world: int, device: str) -> Recipe:
        """This recipe for ``world`` workers on ``device`` ('npu' | 'cpu'), every derived value explicit.

        The launcher writes the result into plan.json; on a resolved recipe this only checks (the worker
        calls it with the world msrun started). Raises :class:`ConfigError` naming each fix.
        """
        if self.layout is not None:  # a plan's recipe: its layout is kept, only checked against this job
            problem = self.layout.world_problem(world, device)
            if problem:
                raise ConfigError([Problem("layout", problem)])
            return copy.deepcopy(self)
        p, t, dev, nodes = self.parallel, self.train, cast(Device, device), self.launch.nnodes  # dev: see docstring
        if p.tp == "auto":
            raise ConfigError([Problem("parallel.tp", "auto is resolved by the launcher first", "2", "'auto'")])
        problems = world_problems(p.tp, p.dp, p.pp, world) + t.device_problems(device) + zero_problems(p.zero,
                                                                                                     p.shard_optimizer)
        if problems:
            raise ConfigError(problems)
        r = copy.deepcopy(self)
        r.layout = decide(LayoutRequest(
            world=world, device=dev, tp=p.tp_size, dp=p.dp, pp=p.pp, zero=p.zero, shard_optimizer=p.shard_optimizer,
            overlap_grad_reduce=p.overlap_grad_reduce, vocab_parallel=p.vocab_parallel,
            host_collectives=p.host_collectives, nnodes=nodes, micro_batch_size=t.micro_batch_size,
            grad_accum=t.grad_accum, seq_len=self.data.seq_len))
        r.train.precision, r.launch.device = t.precision_on(device), dev
        problems = compile_layers_problems(r) + host_collectives_problems(p.host_collectives, r.layout, nodes)
        if problems:
            raise ConfigError(problems)
        if t.compile_layers is None:
            r.train.compile_layers = not compile_layers_refusals(r)
        return r


def resolve_recipe_path(name_or_path: str) -> Path:
    """A recipe name in recipes/ (with or without .yaml) or a path to a YAML file."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    for cand in (RECIPES_DIR / f"{name_or_path}.yaml", RECIPES_DIR / name_or_path, p):
        if cand.is_file():
            return cand
    known = ", ".join(sorted(x.stem for x in RECIPES_DIR.glob("*.yaml")))
    if p.is_dir():
        yamls = sorted(x.name for x in p.glob("*.y*ml"))
        raise ConfigError([f"RECIPE={name_or_path!r}: a directory, not a recipe; give a YAML file"
                           + (f" in it (e.g. RECIPE={p / yamls[0]})" if yamls else f" or one of: {known}")])
    raise ConfigError([f"RECIPE={name_or_path!r}: no such recipe; use one of: {known}, or a path to a YAML file"])


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def load_recipe(name_or_path: str | None = None, overrides: dict[str, Any] | None = None,
                raw: dict[str, Any] | None = None, render: Callable[[Problem], str] = Problem.text) -> Recipe:
    """Recipe YAML (or ``raw``) + dotted overrides -> validated :class:`Recipe`.

    Raises :class:`ConfigError` listing every problem at once, one per key; a problem about a value
    from the recipe file names its line, ``render`` words the rest (the launcher names env variables).
    """
    problems: list[Problem] = []
    data: dict[str, Any] = {}
    lines: dict[str, int] = {}
    where = ""
    if raw is not None:
        data = raw
    elif name_or_path:
        path = resolve_recipe_path(name_or_path)
        data, lines = read_recipe(path)
        data.setdefault("name", path.stem)
        where = _shown(path)
    data = merge(data, nest(overrides or {}), WHOLE_KEYS)
    if "layout" in data and raw is None:  # only a plan's recipe (raw) carries one
        problems.append(Problem("layout", "decided by the launcher from the parallel section (Recipe.resolved), "
                                "not set in a recipe; set parallel.tp, parallel.dp, parallel.shard_optimizer ...",
                                "parallel.shard_optimizer=false"))
        del data["layout"]
    recipe: Recipe = build(Recipe, data, "", problems)
    bad = {p.key for p in problems}
    problems += [p for p in validate(recipe) if p.key not in bad]  # a value that failed to parse fails no range
    if problems:
        over = list(overrides or {})
        problems = [dataclasses.replace(p, where=f"{where}:{lines[p.key]}")
                    if p.key in lines and not overridden(p.key, over) else p for p in problems]
        raise ConfigError(problems, render)
    return recipe


def _at_least(p: list[Problem], lo: float, example: str, **values: float) -> None:
    for key, v in values.items():
        if v < lo:
            p.append(Problem(key.replace("__", "."), f"must be >= {lo:g}", example, repr(v)))


def compile_layers_refusals(r: Recipe) -> list[str]:
    """Why decoder layers cannot run as graphs for ``r``, each "<setting>: <reason>" (the graphs read the
    weights' own memory: every writer of a weight writes in place, optim.update.write_param and the host
    kernel, which DP, ZeRO and fp16 masters were shown to train with; tests/finetune/test_model_graphs.py;
    LoRA's dropout masks are drawn ahead into Parameters, finetune/lora.py).
    A rule on a value still to be derived (precision or device auto) waits for ``Recipe.resolved``."""
    t = r.train
    why = {"train.recompute=true: recompute runs each layer op by op": t.recompute,
           f"parallel.tp={r.parallel.tp}: the tensor-parallel layers' collectives inside a graph are not tried":
               r.parallel.tp_size > 1,
           f"data.max_tokens_per_batch={r.data.max_tokens_per_batch}: every new batch shape compiles each layer "
           "again; packing keeps one shape": r.data.max_tokens_per_batch > 0,
           "launch.device=npu: the fused attention's spec is host data per batch; graphs there are not measured":
               r.launch.device == "npu"}
    return [what for what, on in why.items() if on]


def compile_layers_problems(r: Recipe) -> list[Problem]:
    """train.compile_layers=true where :func:`compile_layers_refusals` says why not."""
    if r.train.compile_layers is not True:
        return []
    return [Problem("train.compile_layers", f"not with {what}", "false", "true") for what in compile_layers_refusals(r)]


def compile_layers_choice(r: Recipe, asked: bool | None) -> str:
    """The plan's line for a resolved ``r`` (``asked``: the recipe's value before resolving)."""
    if r.train.compile_layers:
        return "on: each decoder layer one graph, compiled at the first step" + (" (auto)" if asked is None else "")
    if asked is False:
        return "off (train.compile_layers=false): each layer op by op"
    return "off (auto): " + "; ".join(compile_layers_refusals(r))


def validate(r: Recipe) -> list[Problem]:
    """Ranges and cross-field checks that the types alone do not catch (floats are finite already)."""
    p: list[Problem] = []
    t, c, L = r.train, r.data.clean, r.launch
    p += compile_layers_problems(r) + lora_problems(r.lora)
    p += input_problems(r.data, t.method, r.lora) + eval_problems(r.eval)
    _at_least(p, 1, "1", train__grad_accum=t.grad_accum, train__micro_batch_size=t.micro_batch_size,
              train__epochs=t.epochs, train__log_every=t.log_every, train__max_bad_steps=t.max_bad_steps,
              train__loss_scale__growth_interval=t.loss_scale.growth_interval, parallel__tp=r.parallel.tp_size,
              parallel__pp=r.parallel.pp, launch__nnodes=L.nnodes, launch__cluster_time_out=L.cluster_time_out,
              launch__master_resolve_timeout_s=L.master_resolve_timeout_s,
              data__clean__repeated_chars_max_run=c.repeated_chars_max_run)
    _at_least(p, 8, "1024", data__seq_len=r.data.seq_len)
    _at_least(p, 0, "0", train__max_steps=t.max_steps, train__warmup_steps=t.warmup_steps,
              train__save_every=t.save_every, train__keep_checkpoints=t.keep_checkpoints, parallel__dp=r.parallel.dp,
              launch__max_restarts=L.max_restarts, launch__node_rank=L.node_rank,
              launch__nproc_per_node=L.nproc_per_node, data__max_tokens_per_batch=r.data.max_tokens_per_batch,
              train__loss_chunk_tokens=t.loss_chunk_tokens, data__num_workers=r.data.num_workers,
              data__max_samples=r.data.max_samples, data__clean__min_tokens=c.min_tokens,
              data__clean__max_tokens=c.max_tokens, train__weight_decay=t.weight_decay, train__min_lr=t.min_lr,
              train__clip_grad=t.clip_grad, train__eval_every=t.eval_every,
              train__early_stop_patience=t.early_stop_patience)
    if t.profile_steps and not (len(t.profile_steps) == 2 and 1 <= t.profile_steps[0] <= t.profile_steps[1]):
        p.append(Problem("train.profile_steps", "two steps [start, end], 1 <= start <= end", "3,5",
                         repr(t.profile_steps)))
    for key, v, example in (("train.lr", t.lr, "2e-5"), ("train.eps", t.eps, "1e-6"),
                            ("train.loss_scale.initial", t.loss_scale.initial, "65536")):
        if not v > 0:
            p.append(Problem(key, "must be > 0", example, repr(v)))
    if not t.loss_scale.growth_factor >= 1:
        p.append(Problem("train.loss_scale.growth_factor", "must be >= 1", "2", repr(t.loss_scale.growth_factor)))
    if not 0 < t.loss_scale.backoff_factor < 1:
        p.append(Problem("train.loss_scale.backoff_factor", "a factor in (0, 1)", "0.5",
                         repr(t.loss_scale.backoff_factor)))
    if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
        p.append(Problem("train.betas", "two numbers in [0, 1)", "0.9,0.999", repr(t.betas)))
    if r.parallel.pp != 1:
        p.append(Problem("parallel.pp", "pipeline parallelism is not supported yet; use parallel.pp=1 with "
                                        "tensor parallelism (parallel.tp=2) instead", "1", repr(r.parallel.pp)))
    wm = r.data.worker_malloc
    if wm not in ("auto", "system") and not (wm.startswith("/") and ".so" in wm):
        p.append(Problem("data.worker_malloc", "auto, system or the absolute path of a malloc library",
                         "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", repr(wm)))
    if not 0 < c.mojibake_max_ratio <= 1:
        p.append(Problem("data.clean.mojibake_max_ratio", "a share in (0, 1]", "0.3", repr(c.mojibake_max_ratio)))
    if any(w < 0 for w in r.data.weights):
        p.append(Problem("data.weights", "weights are >= 0", "1,0.5", repr(r.data.weights)))
    if r.data.weights and len(r.data.weights) != len(r.data.paths):
        p.append(Problem("data.weights", f"{len(r.data.weights)} weights for {len(r.data.paths)} paths; "
                                         "give one weight per data.paths entry or none"))
    if not 1 <= L.master_port <= 65535:
        p.append(Problem("launch.master_port", "a TCP port 1..65535", "8118", repr(L.master_port)))
    if L.node_rank >= L.nnodes and not L.hostfile:
        p.append(Problem("launch.node_rank", f"must be < launch.nnodes={L.nnodes}", "0", repr(L.node_rank)))
    try:
        if parse_size(r.export.shard_size) <= 0:
            raise ValueError
    except (ValueError, OverflowError):
        p.append(Problem("export.shard_size", "a size like 2GB or 500MB", "2GB", repr(r.export.shard_size)))
    return p


def resolved_model_dir(r: Recipe) -> str:
    """model.dir, or <output_dir>/base-model where the tiny default is created (no model.dir, model.init set)."""
    if r.model.dir:
        return r.model.dir
    return str(run_dir_of(r).base_model) if r.model.init is not None else ""


def creates_tiny_model(r: Recipe) -> bool:
    """The seeded tiny model is created only where no model directory was given (never over MODEL_DIR)."""
    return not r.model.dir and r.model.init is not None


def to_dict(r: Any) -> dict[str, Any]:
    return dataclasses.asdict(r)
