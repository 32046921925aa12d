"""ascend-finetune launcher: environment -> recipe -> plan -> preflight -> msrun -> supervise.

    python -m launcher {train,plan,preflight,prepare-data,generate,render} [--recipe R] [key=value ...]

Runs once per node, host side; never imports mindspore. Precedence: CLI ``key=value`` > environment
> recipe > schema defaults (finetune/config.py). The CLI also takes the variable names below
(``train TP=2``). Empty variables count as unset. All bad settings are
reported at once, each naming the variable or key and an example fix.

Environment contract (the README table mirrors this one):

==================== ======================== ===============================================================
variable             recipe key               meaning
==================== ======================== ===============================================================
RECIPE               (recipe)                 name in recipes/ or a YAML path; default qwen2.5-7b-full when
                                              NPUs are present and MODEL_DIR and DATA are set, else tiny-cpu
MODEL_DIR            model.dir                Hugging Face model dir (config.json, safetensors, tokenizer.json)
DATA                 data.paths               files or dirs, comma-separated (JSON, JSONL, Parquet)
DATA_FORMAT          data.format              auto | alpaca | sharegpt
OUTPUT_DIR           output_dir               checkpoints, logs, plan.json, hf/ export
NNODES               launch.nnodes            number of nodes (else detected, see below)
NODE_RANK            launch.node_rank         this node's index, 0 = master
MASTER_ADDR          launch.master_addr       node 0's address (msrun scheduler)
MASTER_PORT          launch.master_port       msrun scheduler port (default 8118), same on every node
NPROC_PER_NODE       launch.nproc_per_node    workers per node; default: visible NPU count (CPU: 1)
HOSTFILE             launch.hostfile          file of ``host slots=N`` lines; this node found by name/address
TP / PP / DP         parallel.tp/.pp/.dp      layout; world = TP x DP x PP; DP=0 derives it
OVERRIDES            (any)                    space-separated key=value, e.g. "train.lr=1e-5 train.epochs=1"
NUMA_BIND            launch.numa_bind         auto | numactl | affinity | off
MAX_RESTARTS         launch.max_restarts      relaunches after a failure, each resuming from the last checkpoint
DRY_RUN              launch.dry_run           1: print the plan, start nothing
HCCL_CONNECT_TIMEOUT (worker env)             defaulted to 1200 s when unset
HCCL_EXEC_TIMEOUT    (worker env)             defaulted to 1800 s when unset
HCCL_IF_IP, HCCL_SOCKET_IFNAME, HCCL_BUFFSIZE passed through to workers unchanged
ASCEND_VISIBLE_DEVICES                        physical NPU ids (0-3, 0,2,4); read, not set
ASCEND_RT_VISIBLE_DEVICES                     logical NPU ids; read; set for workers when a subset is used
==================== ======================== ===============================================================

Cluster detection, first match wins (logged with the reason): explicit NNODES / NODE_RANK /
MASTER_ADDR; Volcano (VC_TASK_INDEX, VC_<TASK>_HOSTS, VC_<TASK>_NUM, /etc/volcano/<task>.host);
AscendJob (MS_SCHED_HOST, MS_SCHED_PORT, MS_WORKER_NUM = NPUs in the job, MS_LOCAL_WORKER,
MS_NODE_RANK, RANK_TABLE_FILE waited for until "status": "completed"); torchrun / Kubeflow
(MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK counting nodes, PET_NNODES, PET_NODE_RANK,
PET_NPROC_PER_NODE); HOSTFILE; else one node.

Variables the launcher sets for every worker: PATH (the venv's bin first: msrun starts bare
``python``), PYTHONPATH (repo root first), PYTHONUNBUFFERED=1, HCCL_CONNECT_TIMEOUT and
HCCL_EXEC_TIMEOUT (when unset), ASCEND_RT_VISIBLE_DEVICES (when only some NPUs are used), and the
binding contract read by finetune/affinity.py: AF_BIND_MODE, AF_CPU_BIND_<local_rank>,
AF_MEM_BIND_<local_rank>, AF_NUMACTL_<local_rank>. msrun itself adds MS_* variables, RANK_ID and
DEVICE_ID (= local rank). prepare-data's tokenizer processes (not the workers) are started
with LD_PRELOAD = the malloc of data.worker_malloc before any LD_PRELOAD already set, and
TOKENIZERS_PARALLELISM=false.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from finetune import lifecycle
from finetune.config import REPO_ROOT, ConfigError, Recipe, resolved_model_dir, to_dict
from launcher import cluster as clusterlib
from launcher import devices as deviceslib
from launcher import launch, lock, numa, preflight, settings

COMMANDS = ("train", "plan", "preflight", "prepare-data", "generate", "render")


def log(msg: str) -> None:
    print(f"[launcher] {msg}", flush=True)


@dataclass
class Host:
    """Where probes look; tests point these at fake trees and recorded outputs."""

    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    dev_dir: Path = Path("/dev")
    root: Path = Path("/")
    sys_root: Path = Path("/sys")
    volcano_dir: Path = Path("/etc/volcano")
    identities: set[str] | None = None
    npu_smi: deviceslib.NpuSmi | None = deviceslib.run_npu_smi
    have_numactl: bool | None = None
    command: list[str] | None = None  # replaces the msrun / worker argv (tests use a stub)


@dataclass
class Job:
    recipe: Recipe
    devices: deviceslib.Devices
    cluster: clusterlib.Cluster
    nproc: int
    plan: dict
    argv: list[str]
    env: dict[str, str]
    log_dir: Path
    plan_path: Path


def _optional(module: str, name: str):
    """A function from a module another engineer writes; None until it exists."""
    try:
        return getattr(__import__(module, fromlist=[name]), name)
    except (ImportError, AttributeError):
        return None


def memory_summary(recipe: Recipe, nproc: int, has_npu: bool) -> dict:
    est_fn = _optional("finetune.memory", "estimate_memory")
    cfg = preflight.model_config(recipe)
    if est_fn is None or cfg is None:
        return {"unavailable": "no config.json yet" if cfg is None else "finetune.memory missing"}
    tp = recipe.parallel.tp
    dp = recipe.parallel.dp or max(1, recipe.launch.nnodes * nproc // tp)
    precision = recipe.train.precision if recipe.train.precision != "auto" else ("bf16" if has_npu else "fp32")
    try:
        est = est_fn(cfg, seq_len=recipe.data.seq_len, micro_batch_size=recipe.train.micro_batch_size, tp=tp, dp=dp,
                     precision=precision, recompute=recipe.train.recompute,
                     shard_optimizer=bool(recipe.parallel.shard_optimizer if recipe.parallel.shard_optimizer
                                          is not None else dp > 1), vocab_parallel=recipe.parallel.vocab_parallel,
                     loss_chunk_tokens=recipe.train.loss_chunk_tokens)
    except NotImplementedError:
        return {"unavailable": "finetune.memory.estimate_memory not implemented yet"}
    except ValueError as e:  # a layout the model cannot take; preflight's layout check names the fix
        return {"unavailable": str(e)}
    return {k: getattr(est, k) for k in ("weights", "grads", "master", "optimizer", "activations", "workspace",
                                         "total")}


def memory_line(mem: dict, recipe: Recipe) -> str:
    """``weights 7.1 GiB + ... = total 39.1 GiB per device (...)`` or why there is no estimate."""
    if "total" not in mem:
        return f"memory: no estimate ({mem.get('unavailable')})"
    parts = " + ".join(f"{k} {v / 2**30:.1f}" for k, v in mem.items() if k != "total")
    head = "vocab-parallel" if recipe.parallel.vocab_parallel and recipe.parallel.tp > 1 else "replicated"
    return (f"memory per device (estimate, GiB): {parts} = {mem['total'] / 2**30:.1f} "
            f"(embedding/LM head {head}, seq_len {recipe.data.seq_len}, micro batch {recipe.train.micro_batch_size}, "
            f"recompute {str(recipe.train.recompute).lower()}, loss over chunks of "
            f"{recipe.train.loss_chunk_tokens or 'all'} tokens)")


def _abs(path: str) -> str:
    """Absolute path: as given from the current directory, else relative to the repo (bundled assets)."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists() or not (REPO_ROOT / p).exists():
        return str(p.resolve())
    return str((REPO_ROOT / p).resolve())


def absolutize(recipe: Recipe) -> Recipe:
    """Workers run inside the output dir: every path in the recipe becomes absolute."""
    recipe.output_dir = _abs(recipe.output_dir)
    recipe.model.dir = _abs(recipe.model.dir) if recipe.model.dir else ""
    recipe.data.paths = [_abs(p) for p in recipe.data.paths]
    recipe.data.cache_dir = _abs(recipe.data.cache_dir) if recipe.data.cache_dir else ""
    recipe.launch.hostfile = _abs(recipe.launch.hostfile) if recipe.launch.hostfile else ""
    return recipe


def resolve(args: argparse.Namespace, host: Host) -> Job:
    """Everything up to (not including) side effects: recipe, cluster, devices, binding, argv, plan."""
    devs = deviceslib.probe(host.dev_dir, host.root, host.env, host.npu_smi)
    s = settings.collect(host.env, args.overrides, args.recipe, devs.has_npu)
    first = settings.load(s)
    clus = clusterlib.detect(host.env, first.launch.hostfile, host.identities, host.volcano_dir)
    recipe = absolutize(settings.load(s, extra=clus.overrides()) if clus.overrides() else first)
    device = "npu" if devs.has_npu and recipe.launch.device != "cpu" else "cpu"
    nproc = recipe.launch.nproc_per_node or (len(devs.visible) if device == "npu" else 1) or 1
    ranks, binding = numa.plan(nproc, recipe.launch.numa_bind, devs, host.sys_root, have_numactl=host.have_numactl)
    nodes = numa.numa_nodes(host.sys_root)
    out = Path(recipe.output_dir).resolve()
    log_dir, plan_path = lifecycle.log_dir(out), out / "plan.json"
    world = recipe.launch.nnodes * nproc
    argv = (launch.direct_argv(plan_path) if world == 1
            else launch.msrun_argv(recipe, nproc, plan_path, log_dir))
    env = launch.worker_env(host.env, {**devs.worker_env, **numa.worker_env(ranks, nodes)})
    if world == 1:  # a scheduler's MS_* variables would make the lone worker think msrun started it
        env = {k: v for k, v in env.items() if not k.startswith("MS_")}
    rd = to_dict(recipe)
    rd["model"]["dir"] = resolved_model_dir(recipe)
    rd["launch"].update(device=device if recipe.launch.device == "auto" else recipe.launch.device,
                        nproc_per_node=nproc)
    plan = {
        "recipe": rd,
        "topology": {"nnodes": recipe.launch.nnodes, "node_rank": recipe.launch.node_rank,
                     "nproc_per_node": nproc, "world_size": world, "master_addr": recipe.launch.master_addr,
                     "master_port": recipe.launch.master_port, "tp": recipe.parallel.tp, "pp": recipe.parallel.pp,
                     "dp": recipe.parallel.dp or max(1, world // (recipe.parallel.tp * recipe.parallel.pp))},
        "ranks": [{"local_rank": i, "global_rank": recipe.launch.node_rank * nproc + i,
                   "device": devs.visible[i] if i < len(devs.visible) else None} for i in range(nproc)],
        "binding": {**binding, "ranks": numa.to_json(ranks, nodes)},
        "memory": memory_summary(recipe, nproc, devs.has_npu),
        "msrun_argv": argv,
        "worker_env": launch.set_vars(env, host.env),
        "sources": {"recipe": f"{s.recipe} ({s.recipe_reason})",
                    "cluster": f"{clus.source}: {clus.reason}", "devices": devs.summary(),
                    "device_notes": devs.notes,
                    "launch_mode": "msrun" if world > 1 else "worker started directly: world size 1 needs no "
                                                             "msrun scheduler"},
    }
    return Job(recipe, devs, clus, nproc, plan, argv, env, log_dir, plan_path)


def print_plan(job: Job, full: bool = True) -> None:
    """Log the resolved plan with the reason for each detected value; ``full`` also prints plan.json."""
    p = job.plan
    log(f"recipe: {p['sources']['recipe']}")
    log(f"cluster: {p['sources']['cluster']}")
    log(f"devices: {p['sources']['devices']}")
    for n in p["sources"]["device_notes"]:
        log(f"  {n}")
    t = p["topology"]
    log(f"topology: {t['nnodes']} node(s) x {t['nproc_per_node']} worker(s) = world {t['world_size']} "
        f"(TP {t['tp']} x DP {t['dp']} x PP {t['pp']}); this node {t['node_rank']}; master "
        f"{t['master_addr']}:{t['master_port']}")
    log(f"binding ({p['binding']['method']}, allowed CPUs {p['binding']['allowed_cpus']} from "
        f"{p['binding']['allowed_from']}):")
    for r in p["binding"]["ranks"]:
        log(f"  {r['applied']}")
    log(memory_line(p["memory"], job.recipe))
    log(f"launch ({p['sources']['launch_mode']}): {json.dumps(p['msrun_argv'])}")
    log(f"worker env: {json.dumps(p['worker_env'])}")
    if full:
        print(json.dumps(p, indent=2, default=str), flush=True)


def ensure_model(recipe: Recipe) -> None:
    """Create the seeded tiny model (model.init) when the model dir has no config.json."""
    mdir = resolved_model_dir(recipe)
    if recipe.model.init is None or (Path(mdir) / "config.json").exists():
        return
    fn = _optional("finetune.tiny", "ensure_tiny_model")
    if fn is None:
        log("finetune.tiny.ensure_tiny_model not available yet: the tiny model is not created")
        return
    log(f"creating the tiny model in {mdir} (seed {recipe.model.init_seed})")
    fn(mdir, recipe.model.init, recipe.model.init_seed)


def run_preflight(job: Job, host: Host) -> bool:
    ctx = preflight.Context(job.recipe, job.devices, job.nproc, root=host.root,
                            data_checker=_optional("finetune.data.formats", "check_data"),
                            memory_estimator=_optional("finetune.memory", "estimate_memory"))
    rows = preflight.run_checks(ctx)
    print(preflight.table(rows), flush=True)
    return not preflight.failed(rows)


def prepare_data(recipe: Recipe) -> int:
    fresh = _optional("finetune.data.cache", "cache_is_fresh")
    prep = _optional("finetune.data.prepare", "main")
    if prep is None:
        log("finetune.data.prepare not available yet: skipping data preparation")
        return 0
    tok_for = _optional("finetune.data.prepare", "tokenizer_path_for")
    try:
        tok = tok_for(recipe) if tok_for else Path(resolved_model_dir(recipe)) / "tokenizer.json"
    except ConfigError as e:
        print(f"[launcher] {e}", file=sys.stderr)
        return 2
    if fresh is not None and fresh(recipe, tok):
        log("data cache is fresh")
        return 0
    log("preparing data (cache missing or stale)")
    return int(prep(recipe) or 0)


def _is_override(item: str) -> bool:
    """``train.lr=1e-5`` / ``output_dir=x``: a recipe key (first part a Recipe field) followed by '='."""
    key = item.split("=", 1)[0]
    return "=" in item and key.split(".")[0] in Recipe.__dataclass_fields__


def main(argv: list[str] | None = None, host: Host | None = None) -> int:
    host = host or Host()
    ap = argparse.ArgumentParser(prog="python -m launcher", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=COMMANDS)
    ap.add_argument("--recipe", default=None, help="recipe name in recipes/ or a YAML path (env RECIPE)")
    ap.add_argument("overrides", nargs="*", help="key=value recipe overrides (beat the environment)")
    args, rest = ap.parse_known_intermixed_args(argv)  # overrides may follow --recipe
    if args.command in ("render", "generate"):  # their own options follow; recipe key=value items stay ours
        raw = list(sys.argv[1:] if argv is None else argv)
        mixed = raw[raw.index(args.command) + 1:]
        for i, a in enumerate(mixed):  # --recipe is ours too
            if a == "--recipe":
                del mixed[i:i + 2]
                break
            if a.startswith("--recipe="):
                del mixed[i]
                break
        args.overrides = [a for a in mixed if _is_override(a)]
        rest = [a for a in mixed if not _is_override(a)]
    elif rest:
        ap.error(f"unknown options {rest}")
    try:
        job = resolve(args, host)
    except (ConfigError, clusterlib.ClusterError) as e:
        print(f"[launcher] {e}", file=sys.stderr)
        return 2
    if args.command == "plan" or (args.command == "train" and job.recipe.launch.dry_run):
        print_plan(job)
        return 0
    if args.command == "render":
        fn = _optional("launcher.render", "main")
        if fn is None:
            log("launcher.render is not available in this build")
            return 2
        return int(fn(rest, job.recipe))
    if args.command == "generate":
        script = REPO_ROOT / "finetune" / "generate.py"
        if not any(a.split("=")[0] == "--model-dir" for a in rest):  # default: the export, else the base model
            hf = Path(job.recipe.output_dir) / "hf"
            rest = ["--model-dir", str(hf if (hf / "config.json").exists() else resolved_model_dir(job.recipe)), *rest]
        return subprocess.call([sys.executable, str(script), *rest], env=job.env)
    if args.command == "prepare-data":
        return prepare_data(job.recipe)
    if args.command == "preflight":
        ensure_model(job.recipe)
        return 0 if run_preflight(job, host) else 1
    try:  # one job per OUTPUT_DIR, held until every process of this job is gone
        lock_fd = lock.acquire(Path(job.recipe.output_dir), job.recipe.launch.node_rank, job.recipe.launch.nnodes, log)
    except lock.Locked as e:
        print(f"[launcher] {e}", file=sys.stderr)
        return 1
    try:
        ensure_model(job.recipe)
        if not run_preflight(job, host):
            log("preflight failed: nothing started (fix the rows marked fail above)")
            return 1
        if not (job.recipe.data.shared_storage and job.recipe.launch.node_rank > 0):
            rc = prepare_data(job.recipe)
            if rc:
                return rc
        launch.write_plan(job.plan_path, job.plan)
        print_plan(job, full=False)
        log(f"plan written to {job.plan_path}; starting {'msrun' if len(job.argv) > 4 else 'the worker'}")
        t = job.plan["topology"]
        return launch.supervise(host.command or job.argv, job.env, job.log_dir, job.recipe.launch.max_restarts,
                                cwd=job.plan_path.parent, log=log,
                                tee_to=job.log_dir / "worker_0.log" if t["world_size"] == 1 else None,
                                under_msrun=t["world_size"] > 1, lock_fd=lock_fd,
                                ranks=range(t["node_rank"] * t["nproc_per_node"],
                                            (t["node_rank"] + 1) * t["nproc_per_node"]))
    finally:
        lock.release(lock_fd)


if __name__ == "__main__":
    sys.exit(main())
