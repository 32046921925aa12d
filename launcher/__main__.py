"""ascend-finetune launcher: environment -> recipe -> plan -> preflight -> msrun -> supervise.

Runs once per node, host side; never imports mindspore. Precedence: CLI ``key=value`` > environment
> recipe > schema defaults (jobspec/config.py). The CLI also takes the variable names
(``train TP=2 RECIPE=tiny-cpu``). Empty variables count as unset. All bad settings are reported at
once, each naming the variable or key and an example fix. The environment contract is the table
``launcher.settings.ENV_CONTRACT`` (printed by ``--help``; docs/environment.md's table is generated from it).

Cluster detection, first match wins (logged with the reason): explicit NNODES / NODE_RANK /
MASTER_ADDR; Volcano (VC_TASK_INDEX, VC_<TASK>_HOSTS, VC_<TASK>_NUM, /etc/volcano/<task>.host);
AscendJob (MS_SCHED_HOST, MS_SCHED_PORT, MS_WORKER_NUM = NPUs in the job, MS_LOCAL_WORKER,
MS_NODE_RANK, RANK_TABLE_FILE waited for until "status": "completed"); torchrun / Kubeflow
(MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK counting nodes, PET_NNODES, PET_NODE_RANK,
PET_NPROC_PER_NODE); HOSTFILE (NODE_RANK, when set, picks this node's line); else one node.

Variables the launcher sets for every worker: PATH (the venv's bin first: msrun starts bare
``python``), PYTHONPATH (repo root first), PYTHONUNBUFFERED=1, HCCL_CONNECT_TIMEOUT and
HCCL_EXEC_TIMEOUT (when unset), ASCEND_RT_VISIBLE_DEVICES (when only some NPUs are used), and the
binding contract read by finetune/affinity.py: AF_BIND_MODE, AF_CPU_BIND_<local_rank>,
AF_MEM_BIND_<local_rank>, AF_NUMACTL_<local_rank>; AF_LAUNCHER_PID (jobspec/lifecycle.py).
msrun itself adds MS_* variables, RANK_ID and DEVICE_ID (= local rank). prepare-data's tokenizer
processes (not the workers) are started with LD_PRELOAD = the malloc of data.worker_malloc before
any LD_PRELOAD already set, and TOKENIZERS_PARALLELISM=false.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from jobspec.config import (
    REPO_ROOT,
    ConfigError,
    Recipe,
    compile_layers_choice,
    creates_tiny_model,
    resolved_model_dir,
    to_dict,
)
from jobspec.finish import finished
from jobspec.layout import host_collectives_choice
from jobspec.layout_choice import auto_layout
from jobspec.platform import PLATFORMS, platform_of
from jobspec.rerun import rerun_answer
from jobspec.rundir import run_dir_of
from launcher import (
    ascendjob,
    cli,
    evaluate,
    launch,
    lock,
    master,
    model_check,
    npu_monitor,
    numa,
    plan_checks,
    preflight,
    rundir_prep,
    settings,
)
from launcher import cluster as clusterlib
from launcher import devices as deviceslib
from launcher import plan as planlib


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
    membind_probe: numa.MembindProbe = numa.probe_membind  # `numactl --membind=N --cpunodebind=N true`
    resolver: master.Resolver = master.getaddr  # MASTER_ADDR's name -> address (retried, launcher/master.py)
    command: list[str] | None = None  # replaces the msrun / worker argv (tests use a stub)
    cwd: Path | None = None  # where relative output paths resolve (None: the current directory)


@dataclass
class Job:
    recipe: Recipe  # resolved for this job's world and device (Recipe.resolved)
    devices: deviceslib.Devices
    cluster: clusterlib.Cluster
    plan: planlib.Plan
    env: dict[str, str]

    @property
    def world(self) -> int:
        return self.plan.topology.world_size

    @property
    def nproc(self) -> int:
        """Workers this node starts (0 on an AscendJob Scheduler pod)."""
        return self.plan.topology.nproc_per_node


def _input(path: str) -> str:
    """An input path: as given from the current directory, else relative to the repo (bundled assets)."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists() or not (REPO_ROOT / p).exists():
        return str(p.resolve())
    return str((REPO_ROOT / p).resolve())


def absolutize(recipe: Recipe, cwd: Path) -> Recipe:
    """Workers run inside the output dir: every path (``settings.PATH_KEYS``) becomes absolute. Outputs
    resolve against ``cwd`` always; inputs against ``cwd``, else the repo (bundled assets)."""
    def output(path: str) -> str:
        return str((cwd / Path(path).expanduser()).resolve())

    for key, (role, _) in settings.PATH_KEYS.items():
        *parents, leaf = key.split(".")
        section = functools.reduce(getattr, parents, recipe)
        value, one = getattr(section, leaf), output if role == "output" else _input
        setattr(section, leaf, [one(p) for p in value] if isinstance(value, list) else one(value) if value else "")
    return recipe


def resolve(args: argparse.Namespace, host: Host) -> Job:
    """Everything up to (not including) side effects: recipe, cluster, devices, binding, argv, plan."""
    devs = deviceslib.probe(host.dev_dir, host.root, host.env, host.npu_smi)
    s = settings.collect(host.env, args.overrides, args.recipe, devs.has_npu)
    first = settings.load(s)
    clus = clusterlib.detect(host.env, first.launch.hostfile, host.identities, host.volcano_dir)
    cwd, given_output = host.cwd or Path.cwd(), first.output_dir
    recipe = absolutize(settings.load(s, extra=clus.overrides()) if clus.overrides() else first, cwd)
    wanted = recipe.launch.device  # a recipe made for NPUs is planned for NPUs even where none is visible
    device = platform_of(wanted, devs.has_npu).device
    # NPU recipe, no NPU visible: planned for its smallest world (TP x PP); preflight stops it there
    nproc = (recipe.launch.nproc_per_node or (len(devs.visible) if PLATFORMS[device].accelerator else 1)
             or recipe.parallel.tp_size * recipe.parallel.pp)
    world = recipe.launch.nnodes * nproc
    problems = plan_checks.problems(recipe, s.overrides, clus, nproc, device, devs, host.sys_root)
    chosen: dict[str, tuple[int, str]] = {}
    compile_asked = recipe.train.compile_layers
    try:
        if "auto" in (recipe.parallel.tp, recipe.parallel.zero):  # before resolving: jobspec/layout_choice.py
            chosen = auto_layout(recipe, world, nproc, device)
            for key, (value, _) in chosen.items():
                setattr(recipe.parallel, key.removeprefix("parallel."), value)
        recipe = recipe.resolved(world, device)
    except ConfigError as e:
        if PLATFORMS[device].accelerator and not devs.has_npu:  # preflight's devices row stops the run, naming the fix
            devs.notes.append("no NPU visible, so the layout is not resolved: " + "; ".join(e.problems))
        else:
            problems += e.items
    if problems:
        raise ConfigError(problems, s.render)
    ranks, binding = numa.plan(nproc, recipe.launch.numa_bind, devs, host.sys_root, have_numactl=host.have_numactl,
                               probe=host.membind_probe)
    done = finished(recipe, nproc)  # every path the workers read, decided here and serialised once
    nodes, run = numa.numa_nodes(host.sys_root), run_dir_of(done)
    env = launch.worker_env(host.env, {**devs.worker_env, **numa.worker_env(ranks, nodes)},
                            cpu=PLATFORMS[device].host_memory)
    if world == 1:  # a scheduler's MS_* variables would make the lone worker think msrun started it
        env = {k: v for k, v in env.items() if not k.startswith("MS_")}
    L = recipe.launch
    plan = planlib.Plan(
        recipe=to_dict(done), path=run.plan, run_dir=run, cluster_time_out=L.cluster_time_out,
        topology=planlib.Topology(L.nnodes, L.node_rank, nproc, world, L.master_addr, L.master_port),
        ranks=[{"local_rank": i, "global_rank": L.node_rank * nproc + i,
                "device": devs.visible[i] if i < len(devs.visible) else None} for i in range(nproc)],
        binding={**binding, "ranks": numa.to_json(ranks, nodes)},
        memory=preflight.memory_summary(recipe),
        worker_env=launch.set_vars(env, host.env),
        sources={"recipe": f"{s.recipe} ({s.recipe_reason})",
                 "cluster": f"{clus.source}: {clus.reason}", "devices": devs.summary(L.device, recipe.name),
                 **{key: why for key, (_, why) in chosen.items()},
                 **({"train.compile_layers": compile_layers_choice(recipe, compile_asked), "parallel.host_collectives":
                     host_collectives_choice(recipe.parallel.host_collectives, recipe.layout, L.nnodes)}
                    if recipe.layout else {}),
                 "device_notes": devs.notes,
                 "output_dir": f"{run.root}: output_dir={given_output!r} from {s.origin_of('output_dir')}; "
                               f"a relative path is relative to the current directory ({cwd})",
                 "launch_mode": "msrun" if world > 1 else "started directly: world size 1 needs no msrun scheduler"})
    if clus.role == "scheduler" and not devs.has_npu:  # AscendJob Scheduler pod: msrun's scheduler only
        plan, env = ascendjob.scheduler_only(plan, env, clus)
    return Job(recipe, devs, clus, plan, env)


def print_plan(job: Job, say: Callable[[str], None] = log) -> None:
    """The resolved plan, one line per decision with its reason."""
    p, t, r = job.plan, job.plan.topology, job.recipe
    say(f"recipe: {p.sources['recipe']}")
    say(f"cluster: {p.sources['cluster']}")
    say(f"devices: {p.sources['devices']}")
    for n in p.sources["device_notes"]:
        say(f"  {n}")
    split = f"TP {r.layout.tp} x DP {r.layout.dp} x PP {r.layout.pp}" if r.layout else "layout not resolved"
    say(f"topology: {t.nnodes} node(s) x {t.nproc_per_node} worker(s) = world {t.world_size} "
        f"({split}); this node {t.node_rank}; master {t.master_addr}:{t.master_port}")
    for decided in (k for k in ("parallel.tp", "parallel.zero", "train.compile_layers", "parallel.host_collectives")
                    if k in p.sources):
        say(f"{decided}: {p.sources[decided]}")
    say(f"training: {r.launch.device}, precision {r.train.precision}, "
        f"{r.layout.sharding(r.train.method) if r.layout else 'optimizer state replicated'}")
    say(f"output: {p.sources['output_dir']}")
    say(f"binding ({p.binding['method']}, allowed CPUs {p.binding['allowed_cpus']} from "
        f"{p.binding['allowed_from']}):")
    for key in ("note", "fallback"):
        if key in p.binding:
            say(f"  {p.binding[key]}")
    for rk in p.binding["ranks"]:
        say(f"  {rk['applied']}")
    say(preflight.memory_line(p.memory, job.recipe))
    say(f"launch ({p.sources['launch_mode']}): {json.dumps(p.argv)}")
    say(f"worker env: {json.dumps(p.worker_env)}")


def ensure_model(recipe: Recipe) -> None:
    """Create the seeded tiny model where no model dir was given (model.init), once."""
    if not creates_tiny_model(recipe):
        return
    from jobspec.tiny import ensure_tiny_model

    mdir = resolved_model_dir(recipe)
    if ensure_tiny_model(mdir, recipe.model.init, recipe.model.init_seed):
        log(f"created the tiny model in {mdir} (seed {recipe.model.init_seed})")


def pin_master(job: Job, host: Host) -> bool:
    """Several nodes: MASTER_ADDR's name resolved (retried up to launch.master_resolve_timeout_s) and the
    address put into the plan and msrun's argv, before preflight connects to it; False (said) if it never does."""
    L = job.recipe.launch
    if L.nnodes == 1 or master.is_ip(L.master_addr):
        return True
    try:
        ip = master.resolve_master(L.master_addr, L.master_resolve_timeout_s, host.resolver, log=log)
    except master.MasterUnresolved as e:
        print(f"[launcher] {e}", file=sys.stderr)
        return False
    job.plan.pin_master(ip)
    L.master_addr = ip
    return True


def run_preflight(job: Job, host: Host, skip_selftest: bool = False) -> bool:
    """The preflight table; on an NPU host then the self-test (unless ``skip_selftest``)."""
    from jobspec.data.formats import check_data

    ctx = preflight.Context(job.recipe, job.devices, job.nproc, root=host.root, data_checker=check_data)
    scheduler = job.plan.role == "scheduler"
    rows = ascendjob.scheduler_checks(ctx, job.cluster) if scheduler else preflight.run_checks(ctx)
    print(preflight.table(rows), flush=True)
    if preflight.failed(rows):
        return False
    if not scheduler and job.devices.has_npu and not skip_selftest:
        log("self-test of this node's NPUs (--skip-selftest skips it)")
        return run_selftest(job, []) == 0
    return True


def run_selftest(job: Job, options: list[str]) -> int:
    """``python -m finetune.selftest OUTPUT_DIR`` on this host's devices (its table, selftest.json)."""
    device = platform_of("auto", job.devices.has_npu).device
    return subprocess.call([sys.executable, "-m", "finetune.selftest", job.recipe.output_dir, "--device", device,
                            *options], env=job.env)


def prepare_data(recipe: Recipe) -> int:
    """prepare-data: build the token cache unless a fresh one exists (jobspec.data.prepare decides)."""
    from jobspec.data.prepare import main as prepare_main

    return prepare_main(finished(rundir_prep.cleaned(recipe, log)), table_when_fresh=False)


# ------------------------------------------------------------------------------------ commands

def cmd_plan(job: Job, args: argparse.Namespace, host: Host) -> int:
    """Write plan.json (not under a running job: its restarts read it); print the plan (``--json``: alone)."""
    L = job.recipe.launch
    try:
        with lock.checked(Path(job.recipe.output_dir), L.node_rank, L.nnodes):
            launch.write_plan(job.plan.path, job.plan.to_json())
        written = f"plan written to {job.plan.path}"
    except lock.Locked as e:
        written = f"plan.json not written: {e}"
        print(f"[launcher] {written}", file=sys.stderr, flush=True)
    if not getattr(args, "json", False):
        print_plan(job)
        log(written)
    print(json.dumps(job.plan.to_json(), indent=2, default=str), flush=True)
    return 0


def cmd_prepare_data(job: Job, args: argparse.Namespace, host: Host) -> int:
    return prepare_data(job.recipe)


def cmd_preflight(job: Job, args: argparse.Namespace, host: Host) -> int:
    return 0 if pin_master(job, host) and run_preflight(job, host, getattr(args, "skip_selftest", False)) else 1


def cmd_selftest(job: Job, args: argparse.Namespace, host: Host) -> int:
    return run_selftest(job, args.rest)


def cmd_train(job: Job, args: argparse.Namespace, host: Host) -> int:
    if job.recipe.launch.dry_run:
        return cmd_plan(job, args, host)
    answer = rerun_answer(rundir_prep.cleaned(job.recipe, log), "launcher")  # before any work
    if answer is not None:
        return answer
    if not pin_master(job, host):
        return 1
    # writes nothing but selftest.json: a refused run leaves OUTPUT_DIR otherwise as it was
    if not run_preflight(job, host, getattr(args, "skip_selftest", False)):
        log("preflight failed: nothing started (fix the rows marked fail above)")
        return 1
    try:  # one job per OUTPUT_DIR, held until every process of this job is gone
        # an AscendJob Scheduler pod shares node 0's rank with Worker pod 0: its own lock, .lock.node-1
        scheduler = job.plan.role == "scheduler"
        node = -1 if scheduler else job.recipe.launch.node_rank
        lock_fd = lock.acquire(Path(job.recipe.output_dir), node, job.recipe.launch.nnodes, log)
    except lock.Locked as e:
        print(f"[launcher] {e}", file=sys.stderr)
        return 1
    try:
        ensure_model(job.recipe)
        if not scheduler:  # each node: its own disk, or one shared by all
            rundir_prep.tidy_run_dir(job.recipe, job.plan, log)
        if not scheduler and not (job.recipe.data.shared_storage and job.recipe.launch.node_rank > 0):
            rc = prepare_data(job.recipe)
            if rc:
                return rc
        p, t = job.plan, job.plan.topology
        launch.write_plan(p.path, p.to_json())
        print_plan(job)
        log(f"plan written to {p.path}; starting {'msrun' if job.world > 1 else 'the worker'}")
        with npu_monitor.running(job.devices, p.run_dir.root, t.node_rank,
                                 job.recipe.launch.npu_monitor_s, host.npu_smi, log):
            return launch.supervise(host.command or p.argv, job.env, p.run_dir.logs, job.recipe.launch.max_restarts,
                                    cwd=p.run_dir.root, log=log,
                                    tee_to=p.run_dir.logs / "worker_0.log" if job.world == 1 else None,
                                    under_msrun=job.world > 1, lock_fd=lock_fd,
                                    ranks=range(t.node_rank * t.nproc_per_node, (t.node_rank + 1) * t.nproc_per_node))
    finally:
        lock.release(lock_fd)


def cmd_render(job: Job | None, args: argparse.Namespace, host: Host) -> int:
    from launcher import render

    return int(render.main(args.rest, host.env, overrides=args.overrides, recipe_arg=args.recipe))


def cmd_generate(job: Job, args: argparse.Namespace, host: Host) -> int:
    r = job.recipe  # default: the export; the base model only with --base
    if model_check.adapter_refused(args.rest, resolved_model_dir(r)):  # its shapes against the base's, before loading
        return 2
    ours = ["--device", r.launch.device] + ([] if any(a.split("=")[0] == "--model-dir" for a in args.rest) else
                                            ["--finetuned", str(run_dir_of(r).hf),
                                             "--base-model", resolved_model_dir(r)])
    return subprocess.call([sys.executable, str(GENERATE), *ours, *args.rest], env=job.env)


def cmd_export(job: Job, args: argparse.Namespace, host: Host) -> int:
    r = rundir_prep.cleaned(job.recipe, log)  # the tool's own options come last and win (--dtype fp32)
    return subprocess.call([sys.executable, str(TOOLS["export"]), "--output-dir", r.output_dir, "--model-dir",
                            resolved_model_dir(r), "--dtype", r.export.dtype, "--shard-size", r.export.shard_size,
                            "--merge" if r.export.merge else "--no-merge", *args.rest], env=job.env)


GENERATE = REPO_ROOT / "finetune" / "generate.py"
TOOLS = {"generate": GENERATE, "export": REPO_ROOT / "finetune" / "export.py",
         "selftest": REPO_ROOT / "finetune" / "selftest" / "__main__.py"}
# name -> (handler, one-line help, passes its own options through to a tool with its own --help)
COMMANDS: dict[str, tuple[Callable[[Job, argparse.Namespace, Host], int], str, bool]] = {
    "train": (evaluate.after_training(cmd_train), "preflight, create the tiny model if asked, prepare data, write "
                                                  "plan.json, run msrun and supervise it (eval.after_training)", False),
    "plan": (cmd_plan, "resolve env + recipe + cluster into OUTPUT_DIR/plan.json and print it; start nothing",
             False),
    "preflight": (cmd_preflight, "check devices, driver, files, memory, network and layout; start nothing", False),
    "prepare-data": (cmd_prepare_data, "tokenize, clean and pack the data into the token cache", False),
    "render": (cmd_render, "write a Kubernetes manifest (Volcano Job or AscendJob) for this job", True),
    "generate": (cmd_generate, "answer prompts with the fine-tuned model (the base model with --base)", True),
    "eval": (evaluate.cmd_eval, evaluate.HELP, False),
    "export": (cmd_export, "write a Hugging Face directory from a saved checkpoint (--checkpoint step_N)", True),
    "selftest": (cmd_selftest, "check every fused op, the optimizer and the collectives on this host's devices "
                               "against fp32 references (--quick: one NPU)", True),
}


def help_of_tool(command: str) -> int:
    """``render --help`` / ``generate --help``: the tool's own options, after ours."""
    print(f"{cli.PROG} {command} [--recipe R] [key=value ...] <{command} options>:\n"
          f"  {COMMANDS[command][1]}; recipe settings as for train, then:\n", flush=True)
    if command == "render":
        from launcher import render

        try:
            render.parse_args(["--help"])
        except SystemExit as e:
            return int(e.code or 0)
    return subprocess.call([sys.executable, str(TOOLS[command]), "--help"])


def main(argv: list[str] | None = None, host: Host | None = None) -> int:
    host = host or Host()
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = cli.build_parser(COMMANDS, __doc__.split("\n\n")[0])
    if not argv:
        ap.print_help()
        return 2
    args = cli.parse(ap, argv, COMMANDS)
    if COMMANDS[args.command][2] and any(a in ("-h", "--help") for a in args.rest):
        return help_of_tool(args.command)
    if args.command == "render":  # a manifest for the cluster's pods: nothing of this host is resolved
        return cmd_render(None, args, host)
    try:
        job = resolve(args, host)
    except (ConfigError, clusterlib.ClusterError) as e:
        print(f"[launcher] {e}", file=sys.stderr)
        return 2
    return COMMANDS[args.command][0](job, args, host)


def console_main() -> int:
    """main() with no traceback on the console: an unexpected error is one line, its traceback in a file."""
    try:
        return main()
    except Exception as e:  # the last line of defence; every expected error is handled above
        import tempfile
        import traceback

        fd, path = tempfile.mkstemp(prefix="launcher-error-", suffix=".log")
        with os.fdopen(fd, "w") as f:
            traceback.print_exc(file=f)
        print(f"[launcher] error: {type(e).__name__}: {e} (full traceback in {path})", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(console_main())
