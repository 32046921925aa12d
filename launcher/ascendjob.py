"""The AscendJob Scheduler pod: msrun's scheduler only, no workers, no NPU.

ascend-operator (mind-cluster ``component/ascend-operator/pkg/controllers/v1``, ``env.go``) gives a
``framework: mindspore`` AscendJob one Scheduler pod (``MS_ROLE=MS_SCHED``, ``MS_SCHED_HOST`` = its own
pod IP, ``MS_NODE_RANK=0``) and N Worker pods (``MS_ROLE=MS_WORKER``, ``MS_SCHED_HOST`` = the
scheduler Service's IP, ``MS_NODE_RANK`` = index); every pod gets ``MS_WORKER_NUM`` (NPUs in the job),
``MS_LOCAL_WORKER`` (NPUs per worker pod), ``MS_SCHED_PORT`` and ``MS_SERVER_NUM=0``.

msrun 2.10 (``mindspore/parallel/cluster/process_entity/_api.py``) starts the scheduler process when
``--master_addr`` is an address of this host, and ``--local_worker_num`` workers. On the Scheduler pod
the launcher therefore runs msrun with ``--master_addr`` = its own IP and ``--local_worker_num 0``; the
worker pods (Service IP, not local) start their workers only, ``--node_rank`` = ``MS_NODE_RANK``.
A Scheduler pod that holds NPUs (the operator's mount-chips-on-scheduler mode) is an ordinary node 0.
"""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

from jobspec.config import Recipe
from launcher import launch, preflight
from launcher.cluster import Cluster

PLAN_NAME = "plan-scheduler.json"  # not plan.json: worker pods sharing OUTPUT_DIR read theirs


def scheduler_only(recipe: Recipe, cluster: Cluster, plan: dict, env: dict[str, str],
                   out: Path) -> tuple[list[str], dict[str, str], dict, Path]:
    """(msrun argv, env, plan, plan path) of a Scheduler pod: the scheduler process, zero workers.

    The scheduler process runs the worker script too (msrun gives it MS_ROLE=MS_SCHED); it stops in
    ``mindspore.communication.init()``, which serves the cluster, so it never reads the model or data.
    """
    workers = cluster.nproc_per_node or 1
    plan_path, log_dir = out / PLAN_NAME, out / "logs"
    argv = launch.msrun_argv(recipe, workers, plan_path, log_dir)
    argv[argv.index("--local_worker_num") + 1] = "0"
    plan = copy.deepcopy(plan)
    # No NPU here and nothing to compute: the worker script's checks (train.run resolves the recipe for
    # its device before init()) must pass on CPU, so the scheduler's own plan says cpu and fp32.
    plan["recipe"]["launch"]["device"], plan["recipe"]["train"]["precision"] = "cpu", "fp32"
    plan["topology"]["nproc_per_node"] = 0
    plan["ranks"], plan["binding"]["ranks"], plan["msrun_argv"] = [], [], argv
    env = {k: v for k, v in env.items() if not k.startswith("AF_")}
    plan["worker_env"] = {k: v for k, v in plan["worker_env"].items() if not k.startswith("AF_")}
    plan["sources"]["launch_mode"] = (
        f"AscendJob Scheduler pod: msrun runs the scheduler only (--local_worker_num 0; MS_SCHED_HOST="
        f"{cluster.master_addr} is this pod, so msrun starts the scheduler) for {plan['topology']['world_size']} "
        "workers on the Worker pods")
    return argv, env, plan, plan_path


def scheduler_checks(ctx: preflight.Context, cluster: Cluster) -> list[preflight.Check]:
    """The Scheduler pod's preflight: its port and the job's layout; NPU, model and data are the workers'."""
    ctx = dataclasses.replace(ctx, nproc=cluster.nproc_per_node or 1)
    role = preflight.Check("role", "ok", "AscendJob Scheduler pod (MS_ROLE=MS_SCHED): msrun's scheduler only; "
                                         "devices, model, data and memory are checked on the Worker pods")
    return [role, *preflight.check_network(ctx), *preflight.check_world(ctx)]
