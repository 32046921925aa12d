"""The recipe schema: typed dataclasses that are the one source of defaults.

Pure Python (no mindspore import) so the launcher can validate recipes in milliseconds. A recipe is
YAML whose sections mirror these dataclasses; ``key=value`` overrides use dotted paths (``train.lr=1e-5``).
Unknown keys and bad values are collected, never asserted, and reported all at once by :class:`ConfigError`.
Each key's facts (range, what it changes, path, env variable) sit on its field (``key(...)``, jobspec/keys.py).
Loading a recipe: ``jobspec/recipe_load.py``; its checks: ``jobspec/validate.py``; reading YAML and overrides and
coercing values to these types: ``jobspec/recipe_parse.py``; resolving for a world and device: ``Recipe.resolved``.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

# ConfigError, Problem, overridden, parse_overrides and parse_size are imported from here across the project
from jobspec.eval_config import EvalConfig
from jobspec.keys import key
from jobspec.layout import Layout, LayoutRequest, decide, host_collectives_problems, world_problems, zero_problems
from jobspec.lora_config import LoraConfig
from jobspec.platform import PLATFORMS, Device, platform_of
from jobspec.recipe_parse import ConfigError as ConfigError
from jobspec.recipe_parse import Problem as Problem
from jobspec.recipe_parse import overridden as overridden
from jobspec.recipe_parse import parse_overrides as parse_overrides
from jobspec.recipe_parse import parse_size as parse_size
from jobspec.rundir import run_dir_of

REPO_ROOT = Path(__file__).resolve().parent.parent
RECIPES_DIR = REPO_ROOT / "recipes"
ASSETS_DIR = REPO_ROOT / "assets"
# The environment variables' longer meanings (the env table, launcher/settings.py), on their keys below
MODEL_HELP = ("Hugging Face model dir (`config.json`, safetensors + index, `tokenizer.json`); unset with `tiny-cpu`: "
              "the tiny model created in `OUTPUT_DIR/base-model`")
DATA_HELP = ("files or dirs, comma-separated (JSON, JSONL, Parquet, .txt); the format is detected "
             "(`data.format=auto`) unless `DATA_FORMAT` is set")
OUTPUT_HELP = ("checkpoints, `logs/worker_<rank>.log`, `plan.json`, `hf/` export; a relative path is relative to the "
               "current directory")
NPROC_HELP = ("workers per node; default the visible NPU count (no NPU: 1); more than the NPUs (CPU workers: the "
              "allowed CPUs) is refused")
HOSTFILE_HELP = ("`host slots=N` (or MPI's `host:N`) lines, the same slots on every line (see `hostfiles/`); this node "
                 "is the line naming one of its host names or interface addresses, or `NODE_RANK`")
NUMA_HELP = "`auto` (numactl if installed, else CPU affinity) \\| `numactl` \\| `affinity` \\| `off`"


@dataclass
class ModelConfig:
    """Where the Hugging Face model lives (MODEL_DIR), or how to create the tiny default."""

    # HF layout: config.json, *.safetensors (+ index), tokenizer.json
    dir: str = key("", path="input", example="models/Qwen2.5-7B-Instruct", env="MODEL_DIR", env_help=MODEL_HELP)
    # When set and `dir` holds no config.json: create a seeded random-init Qwen2 model there,
    # with these config.json fields over a tiny default, and the bundled Qwen2.5 tokenizer.
    init: dict[str, Any] | None = None
    init_seed: int = 0
    # tokenizer.json; empty: <dir>/tokenizer.json (the created tiny model: the bundled one)
    tokenizer: str = key("", path="input", example="models/Qwen2.5-7B-Instruct/tokenizer.json")


@dataclass
class CleanConfig:
    """Rule-based cleaning applied by prepare-data; each rule switchable and counted."""

    empty_response: bool = True
    repeat_prompt: bool = True
    repeated_chars: bool = True
    # a run of the same punctuation/char longer than this drops
    repeated_chars_max_run: int = key(10, ge=1, example="1")
    mojibake: bool = True
    # share of non-printable / U+FFFD characters that drops
    mojibake_max_ratio: float = key(0.3, gt=0, le=1, rule="a share in (0, 1]", example="0.3")
    invalid_utf8: bool = True
    dedup: bool = True
    min_tokens: int = key(4, ge=0, example="0")  # whole templated sample, in tokens
    max_tokens: int = key(0, ge=0, example="0")  # 0: no upper bound beyond data.seq_len truncation


@dataclass
class DataConfig:
    """Instruction data (DATA, DATA_FORMAT) and how it becomes token batches."""

    # files or dirs; JSON, JSONL or Parquet
    paths: list[str] = key(factory=list, path="input", example="sft/train.jsonl", env="DATA", env_help=DATA_HELP)
    format: Literal["auto", "alpaca", "sharegpt", "text"] = key(
        "auto", cache="always", env="DATA_FORMAT", env_help="`auto` \\| `alpaca` \\| `sharegpt` \\| `text`")
    # the formats' field names -> this dataset's own, e.g. {"instruction": "question", "output": "answer"}
    columns: dict[str, str] = key(factory=dict, cache="when_set")
    # skip: malformed records are dropped and counted in the report
    on_error: Literal["fail", "skip"] = key("fail", cache="when_set")
    # held out for validation: a fraction (< 1) or a count (>= 1) of the samples
    val_size: float = key(0.0, cache="when_set")
    # validation files (instead of val_size)
    val_paths: list[str] = key(factory=list, cache="when_set", path="input", example="sft/val.jsonl")
    weights: list[float] = field(default_factory=list)  # one per path; empty: all 1.0
    seq_len: int = key(1024, ge=8, example="1024", training=True, cache="always")
    packing: bool = key(True, training=True)
    system_prompt: str = key("You are a helpful assistant.", cache="always")
    # reasoning (reasoning_content, or <think>...</think> opening an answer); auto: keep what the data has
    thinking: Literal["auto", "keep", "drop"] = key("auto", cache="when_set")
    # >0: dynamic batching by token budget instead of packing
    max_tokens_per_batch: int = key(0, ge=0, example="0", training=True)
    cache_dir: str = key("", path="output", example="output/run1/data")  # token cache; default <output_dir>/data
    shared_storage: bool = False  # True: one process per job prepares (output on shared FS)
    # tokenizer processes for prepare-data; 0: auto (from 8 MB of input one per CPU, at most 8)
    num_workers: int = key(0, ge=0, example="0")
    max_samples: int = key(0, ge=0, example="0", cache="always")  # 0: all
    # tokenizer processes' malloc: auto (the cmeel-mimalloc wheel, else a system tcmalloc/jemalloc/mimalloc)
    # | system | path
    worker_malloc: str = "auto"
    clean: CleanConfig = key(factory=CleanConfig, cache="always")


@dataclass
class LossScaleConfig:
    """Dynamic loss scaling for train.precision=fp16."""

    initial: float = key(65536.0, gt=0, example="65536")
    growth_factor: float = key(2.0, ge=1, example="2")
    backoff_factor: float = key(0.5, gt=0, lt=1, rule="a factor in (0, 1)", example="0.5")
    growth_interval: int = key(2000, ge=1, example="1")


@dataclass
class TrainConfig:
    """Optimizer, schedule, batch and checkpoint settings (defaults from the field guide)."""

    method: Literal["full", "lora"] = key("full", training=True)  # lora: adapters on the frozen base (the lora section)
    lr: float = key(2e-5, gt=0, example="2e-5", training=True)
    betas: list[float] = key(factory=lambda: [0.9, 0.999], training=True)
    eps: float = key(1e-6, gt=0, example="1e-6", training=True)
    weight_decay: float = key(0.01, ge=0, example="0", training=True)
    warmup_steps: int = key(0, ge=0, example="0", training=True)
    schedule: Literal["cosine", "constant"] = key("cosine", training=True)
    min_lr: float = key(0.0, ge=0, example="0", training=True)
    clip_grad: float = key(1.0, ge=0, example="0", training=True)  # 0: no clipping
    grad_accum: int = key(1, ge=1, example="1")
    micro_batch_size: int = key(1, ge=1, example="1", training=True)
    epochs: int = key(1, ge=1, example="1")
    max_steps: int = key(0, ge=0, example="0")  # 0: derived from epochs
    recompute: bool = False  # per-layer activation recompute
    # each decoder layer as one mindspore.jit graph (docs/speed.md); unset (auto): on wherever
    # compile_layers_refusals finds no reason against it (on CPU: DP, ZeRO and fp16 included)
    compile_layers: bool | None = None
    # LM head + cross-entropy over chunks of this many label tokens (0: all at once)
    loss_chunk_tokens: int = key(1024, ge=0, example="0")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: fp32 on CPU, bf16 on Ascend
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    seed: int = key(42, training=True)
    log_every: int = key(1, ge=1, example="1")
    save_every: int = key(0, ge=0, example="0")  # 0: only at the end
    keep_checkpoints: int = key(2, ge=0, example="0")  # 0: keep all
    resume: str = "auto"  # auto | never | <checkpoint dir>
    tensorboard: bool = True  # scalar event files under <output_dir>/tensorboard (rank 0)
    # Stop after this many consecutive steps with a non-finite loss or gradients. fp16's dynamic loss
    # scale skips a step per backoff (65536 -> 1 takes 16); bf16/fp32 have no scale to lower.
    max_bad_steps: int = key(20, ge=1, example="1")
    # eval loss on the validation set (data.val_size / data.val_paths) every N steps; 0: at the end
    eval_every: int = key(0, ge=0, example="0")
    # stop after this many evaluations without a better eval loss; 0: never
    early_stop_patience: int = key(0, ge=0, example="0")
    profile_steps: list[int] = field(default_factory=list)  # [start, end]: profile these steps on rank 0

    def precision_on(self, device: str) -> Literal["fp32", "bf16", "fp16"]:
        """The concrete precision on ``device`` ('npu' | 'cpu'): auto is bf16 on NPU, fp32 on CPU."""
        return PLATFORMS[device].default_precision if self.precision == "auto" else self.precision

    def device_problems(self, device: str) -> list[Problem]:
        if self.precision_on(device) == "bf16" and not PLATFORMS[device].bf16_matmul:
            return [Problem("train.precision", "the CPU has no bf16 matmul; use fp32 (or fp16) on CPU, bf16 on "
                            "Ascend", "fp32", repr(self.precision))]
        return []


@dataclass
class ParallelConfig:
    """The layout asked for: world = tp x dp x pp (tp auto: the launcher's ``jobspec.layout_choice.auto_layout``).
    ``Recipe.resolved`` decides the rest into its ``layout``."""

    tp: int | Literal["auto"] = key(1, ge=1, example="1", env="TP", env_help="tensor-parallel size (world = TP x DP x "
                                    "PP), or `auto`: the smallest that fits")
    dp: int = key(0, ge=0, example="0", env="DP", env_help="data-parallel size; `0` derives it from the world size")
    pp: int = key(1, ge=1, example="1", env="PP", env_help="pipeline-parallel size (1)")
    shard_optimizer: bool | None = None  # unset: on when dp > 1
    vocab_parallel: bool = True  # tp > 1: embedding/LM head split by vocab rows, parallel cross-entropy
    overlap_grad_reduce: bool = True  # dp > 1: each gradient bucket's reduction starts during the backward
    host_collectives: bool | None = None  # DP sums via /dev/shm (CPU, one node); unset: where jobspec.layout allows
    # ZeRO stage over DP (jobspec.layout.zero_problems); auto: 1 when dp > 1
    zero: int | Literal["auto"] = key("auto", example="2")

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
    nnodes: int = key(1, ge=1, example="1", env="NNODES",
                      env_help="nodes in the job (else detected, see below); more than one needs `MASTER_ADDR`")
    node_rank: int = key(0, ge=0, example="0", env="NODE_RANK", env_help="this node, 0 = master")
    master_addr: str = key("127.0.0.1", env="MASTER_ADDR", env_help="node 0's address (msrun scheduler)")
    master_port: int = key(8118, ge=1, le=65535, rule="a TCP port 1..65535", example="8118", env="MASTER_PORT",
                           env_help="scheduler port, default {default}, same on every node")
    # 0: visible NPU count (CPU: 1)
    nproc_per_node: int = key(0, ge=0, example="0", env="NPROC_PER_NODE", env_help=NPROC_HELP)
    hostfile: str = key("", path="input", example="hostfiles/two-nodes.txt", env="HOSTFILE", env_help=HOSTFILE_HELP)
    numa_bind: Literal["auto", "numactl", "affinity", "off"] = key("auto", env="NUMA_BIND", env_help=NUMA_HELP)
    max_restarts: int = key(0, ge=0, example="0", env="MAX_RESTARTS",
                            env_help="relaunches after a failure; each resumes from the newest checkpoint (not "
                                     "after a device out of memory: it would run out again)")
    cluster_time_out: int = key(600, ge=1, example="1")
    # how long the launcher retries resolving MASTER_ADDR's name
    master_resolve_timeout_s: int = key(600, ge=1, example="1")
    dry_run: bool = key(False, env="DRY_RUN",
                        env_help="`1`: `train` writes and prints the plan and starts nothing (same as `plan`)")
    npu_monitor_s: float = 30.0  # npu-smi sampling into OUTPUT_DIR/npu.jsonl while training; 0: off


@dataclass
class Recipe:
    """A whole job: the YAML recipe resolved with env and CLI overrides."""

    name: str = ""
    output_dir: str = key("./output", path="output", example="output/run1", env="OUTPUT_DIR", env_help=OUTPUT_HELP)
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
        problems = world_problems(p.tp, p.dp, p.pp, world) + t.device_problems(device) + zero_problems(
            p.zero, p.shard_optimizer)
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


def compile_layers_refusals(r: Recipe) -> list[str]:
    """Why decoder layers cannot run as graphs for ``r``, each "<setting>: <reason>" (the graphs read the
    weights' own memory: every writer of a weight writes in place, optim.update.write_param and the host
    kernel, which DP, ZeRO and fp16 masters were shown to train with; tests/finetune/test_model_graphs.py;
    LoRA's dropout masks are drawn ahead into Parameters, finetune/model/lora.py).
    A rule on a value still to be derived (precision or device auto) waits for ``Recipe.resolved``."""
    t = r.train
    why = {"train.recompute=true: recompute runs each layer op by op": t.recompute,
           f"parallel.tp={r.parallel.tp}: the tensor-parallel layers' collectives inside a graph are not tried":
               r.parallel.tp_size > 1,
           f"data.max_tokens_per_batch={r.data.max_tokens_per_batch}: every new batch shape compiles each layer "
           "again; packing keeps one shape": r.data.max_tokens_per_batch > 0,
           "launch.device=npu: the fused attention's spec is host data per batch; graphs there are not measured":
               platform_of(r.launch.device, has_npu=False).fused_kernels,
           "parallel.zero=3: a layer's weights are gathered around each call, which a graph does not see":
               r.parallel.zero == 3}
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
