"""`python -m launcher render {volcano,ascendjob} --nodes N`: Kubernetes manifests for this image.

The pods' env carries what the user gave render (``RECIPE``, the env-contract variables, ``OVERRIDES``
and command-line ``key=value`` items, the HCCL variables), never this machine's resolved values: paths
must be pod paths on the volume mounted at ``--data-dir``. Cluster shape is not in the env: in the pod
the launcher finds it from what Volcano's svc/env plugins or ascend-operator inject
(``launcher/cluster.py``). ``NPROC_PER_NODE`` sets the NPU request.

Pure Python (yaml only): the launcher imports it without MindSpore.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jobspec.config import RECIPES_DIR, ConfigError, LaunchConfig
from jobspec.recipe_load import resolve_recipe_path
from launcher import settings

DEFAULT_IMAGE = "ascend-finetune:latest"
NPUS_PER_NODE = 8  # Atlas 800T A2
NPU_RESOURCE = "huawei.com/Ascend910"
ENTRYPOINT = "/opt/ascend-finetune/entrypoint.sh"
TASK = "worker"  # Volcano injects VC_WORKER_HOSTS / VC_WORKER_NUM for this task name
ASCEND_CONTAINER = "ascend"  # ascend-operator writes its env only into the container of this name
ASCEND_PORT_NAME = "ascendjob-port"  # the operator's scheduler Service uses the container port of this name
GRACE_SECONDS = 600  # time for the launcher to forward SIGTERM and the workers to save a checkpoint
MASTER_PORT = LaunchConfig.master_port
LABELS = {"app": "ascend-finetune", "ring-controller.atlas": "ascend-910b"}
NODE_SELECTOR = {"accelerator-type": "module-910b-8"}
# Host driver pieces the container needs (read-only): path -> hostPath type.
DRIVER_MOUNTS = {
    "/usr/local/Ascend/driver": "Directory",
    "/usr/local/dcmi": "Directory",
    "/usr/local/bin/npu-smi": "File",
    "/etc/ascend_install.info": "File",
}
# Environment passed through unchanged when set where render runs (not recipe keys).
PASS_ENV = settings.HCCL_VARS
# Recipe keys the pods must not be given: the scheduler's variables say them, per pod.
CLUSTER_KEYS = {"launch.nnodes": "--nodes N", "launch.node_rank": "nothing (each pod finds its own)",
                "launch.master_addr": "nothing (node 0 is found from the scheduler's variables)",
                "launch.hostfile": "nothing (the scheduler lists the pods)"}
VAR_OF = {key: var for var, key in settings.ENV_KEYS.items()}


@dataclass
class PodSettings:
    """What every pod of the job gets; one place for both manifests."""

    image: str
    env: dict[str, str]
    npus: int
    cpu: str
    memory: str
    shm: str
    data_dir: str
    pvc: str
    port: int
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _under(path: str, root: str) -> bool:
    return Path(path).is_absolute() and Path(os.path.normpath(path)).is_relative_to(root)


def _given_recipe(env: Mapping[str, str], overrides: list[str], recipe_arg: str | None) -> str | None:
    """The recipe the user named: --recipe, RECIPE=... on the command line, or the RECIPE variable."""
    cli = [i.split("=", 1)[1] for i in overrides if i.startswith("RECIPE=")]
    return recipe_arg or (cli[-1] if cli else None) or settings.env_value(env, "RECIPE")


def _pod_recipe(given: str, data_dir: str) -> tuple[str, str | None]:
    """(RECIPE for the pod, problem): a bundled recipe by name, a pod path as is, a file of this machine refused."""
    if _under(given, data_dir):
        return given, None
    try:
        path = resolve_recipe_path(given)
    except ConfigError as e:
        return given, str(e.problems[0])
    if path.resolve().parent == RECIPES_DIR.resolve():
        return path.stem, None
    known = ", ".join(sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
    return given, (f"RECIPE={given}: a file of this machine; the image has the recipes {known}: put it on the "
                   f"shared volume and give its pod path (e.g. RECIPE={data_dir}/recipes/{Path(given).name}) or "
                   "add it to recipes/ and rebuild the image")


def _path_problems(given: dict[str, str], origin: dict[str, str], data_dir: str) -> list[str]:
    out = []
    for key, (_, example) in settings.PATH_KEYS.items():
        for path in (p.strip() for p in given.get(key, "").split(",") if p.strip()):
            if not _under(path, data_dir):
                name = VAR_OF.get(key, key) if origin.get(key) != "OVERRIDES" else f"OVERRIDES {key}"
                out.append(f"{name}={path}: not a path on the volume mounted at --data-dir {data_dir} in every "
                           f"pod (a path of this machine is not in the pod); e.g. {VAR_OF.get(key, key)}="
                           f"{data_dir}/{example}")
    return out


def _recipe_problems(s: settings.Settings, given: dict[str, str], data_dir: str) -> list[str]:
    """The recipe with the given settings, loaded here (bundled recipes are the image's): what cannot run."""
    try:
        recipe = settings.load(settings.Settings(s.recipe, s.recipe_reason, given, s.origin, s.problems))
    except ConfigError as e:
        return e.problems
    out = []
    if recipe.model.init is None and not recipe.model.dir:
        out.append(f"MODEL_DIR is not set: recipe {s.recipe} needs a Hugging Face model dir "
                   f"(e.g. MODEL_DIR={data_dir}/models/Qwen2.5-7B-Instruct)")
    if not recipe.data.paths:
        out.append(f"DATA is not set: recipe {s.recipe} needs training data (e.g. DATA={data_dir}/sft/train.jsonl)")
    return out


def _npus(given: dict[str, str], pod: PodSettings) -> None:
    """NPROC_PER_NODE is the NPU request (1 to 8); MASTER_PORT the container port."""
    nproc = given.get("launch.nproc_per_node", str(NPUS_PER_NODE))
    if not nproc.isdigit() or not 1 <= int(nproc) <= NPUS_PER_NODE:
        pod.problems.append(f"NPROC_PER_NODE={nproc}: NPUs per pod, 1 to {NPUS_PER_NODE} (e.g. NPROC_PER_NODE=8)")
    else:
        pod.npus = int(nproc)
    port = given.get("launch.master_port", "")
    pod.port = int(port) if port.isdigit() else MASTER_PORT


def pod_settings(ns: argparse.Namespace, name: str, env: Mapping[str, str], overrides: list[str],
                 recipe_arg: str | None) -> PodSettings:
    """The pods' env from what the user gave, checked: pod paths, no cluster keys, a loadable recipe."""
    s = settings.collect(env, overrides, recipe_arg, has_npu=True)  # the recipe each pod picks: it has NPUs
    given, pod = dict(s.overrides), PodSettings(ns.image, {}, NPUS_PER_NODE, ns.cpu, ns.memory, ns.shm,
                                                 ns.data_dir, ns.pvc, MASTER_PORT)
    if s.recipe == settings.CPU_RECIPE and not _given_recipe(env, overrides, recipe_arg):
        pod.problems.append(
            f"no RECIPE, and MODEL_DIR and DATA are not both set: every pod would run {s.recipe} (the tiny "
                   f"model on CPU) while holding NPUs; set MODEL_DIR and DATA (pod paths, e.g. MODEL_DIR="
                   f"{ns.data_dir}/{settings.PATH_KEYS['model.dir'][1]} DATA={ns.data_dir}/"
                   f"{settings.PATH_KEYS['data.paths'][1]}) for {settings.NPU_RECIPE}, or RECIPE=... on purpose")
    for key, fix in CLUSTER_KEYS.items():
        if key in given:
            pod.problems.append(f"{VAR_OF.get(key, key)}={given.pop(key)}: the pods must not be given it; use {fix}")
    _npus(given, pod)
    given.setdefault("output_dir", f"{ns.data_dir}/output/{name}")
    if ns.pvc:
        given.setdefault("data.shared_storage", "true")  # one preparer per job on the shared volume
    elif ns.nodes > 1:
        pod.warnings.append(f"--data-dir {ns.data_dir} is a hostPath: each node has its own; checkpoints and the "
                            f"export in {given['output_dir']} are split across the nodes' disks and a pod restarted "
                            "on another node cannot resume: use --pvc CLAIM (ReadWriteMany shared storage)")
    pod.problems += _path_problems(given, s.origin, ns.data_dir)
    recipe_name, recipe_problem = _pod_recipe(s.recipe, ns.data_dir)
    if recipe_problem:
        pod.problems.append(recipe_problem)
    elif _under(s.recipe, ns.data_dir):
        pod.warnings.append(f"RECIPE={s.recipe} is a pod path: its keys are checked when the pods start, not here")
    else:
        pod.problems += _recipe_problems(s, given, ns.data_dir)
    rest = settings.join_overrides({k: v for k, v in given.items() if k not in VAR_OF})
    pod.env = {"RECIPE": recipe_name, **{VAR_OF[k]: v for k, v in given.items() if k in VAR_OF},
               "NPROC_PER_NODE": str(pod.npus), **({"OVERRIDES": rest} if rest else {}),
               **{k: env[k] for k in PASS_ENV if settings.env_value(env, k)}}
    return pod


def _volumes(pod: PodSettings) -> tuple[list[dict], list[dict]]:
    """(volumes, volumeMounts): /dev/shm in memory with a size limit, the driver read-only, the data dir."""
    vols = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": pod.shm}}]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    for i, (path, kind) in enumerate(DRIVER_MOUNTS.items()):
        vols.append({"name": f"ascend-{i}", "hostPath": {"path": path, "type": kind}})
        mounts.append({"name": f"ascend-{i}", "mountPath": path, "readOnly": True})
    source = ({"persistentVolumeClaim": {"claimName": pod.pvc}} if pod.pvc
              else {"hostPath": {"path": pod.data_dir, "type": "Directory"}})
    vols.append({"name": "data", **source})
    mounts.append({"name": "data", "mountPath": pod.data_dir})
    return vols, mounts


def pod_template(pod: PodSettings, container: str = "finetune", npus: bool = True,
                 port_name: str = "master") -> dict:
    """One pod: the entrypoint, NPUs (or none), CPU/memory requests, driver mounts, a checkpoint-sized grace."""
    vols, mounts = _volumes(pod)
    req = {"cpu": pod.cpu, "memory": pod.memory, **({NPU_RESOURCE: pod.npus} if npus else {})}
    lim = {"memory": pod.memory, **({NPU_RESOURCE: pod.npus} if npus else {})}  # no CPU limit: no throttling
    return {
        "metadata": {"labels": dict(LABELS)},
        "spec": {
            "terminationGracePeriodSeconds": GRACE_SECONDS,
            "restartPolicy": "Never",
            "nodeSelector": dict(NODE_SELECTOR),
            "containers": [{
                "name": container,
                "image": pod.image,
                "imagePullPolicy": "IfNotPresent",
                "command": [ENTRYPOINT],
                "args": ["train"],
                "env": [{"name": k, "value": v} for k, v in pod.env.items()],
                "ports": [{"name": port_name, "containerPort": pod.port}],
                "resources": {"requests": req, "limits": lim},
                "volumeMounts": mounts,
                # NUMA memory binding: the runtime's default seccomp profile allows set_mempolicy only with it
                "securityContext": {"capabilities": {"add": ["SYS_NICE"]}},
            }],
            "volumes": vols,
        },
    }


def volcano_job(pod: PodSettings, nodes: int, name: str, queue: str, max_retry: int) -> dict:
    """A Volcano Job: gang-scheduled N pods, restarted whole when a pod fails or is evicted."""
    return {
        "apiVersion": "batch.volcano.sh/v1alpha1",
        "kind": "Job",
        "metadata": {"name": name, "labels": dict(LABELS)},
        "spec": {
            "schedulerName": "volcano",
            "queue": queue,
            "minAvailable": nodes,
            "maxRetry": max_retry,
            "plugins": {"svc": ["--publish-not-ready-addresses=true"], "env": []},
            "policies": [  # a failed pod would leave its peers waiting for the HCCL timeout
                {"event": "PodFailed", "action": "RestartJob"},
                {"event": "PodEvicted", "action": "RestartJob"},
                {"event": "TaskCompleted", "action": "CompleteJob"},
            ],
            "tasks": [{"name": TASK, "replicas": nodes, "template": pod_template(pod)}],
        },
    }


def ascend_job(pod: PodSettings, nodes: int, name: str, queue: str, max_retry: int) -> dict:
    """An AscendJob (ascend-operator): one Scheduler pod without NPUs running msrun's scheduler, N Workers.

    The operator gives every pod MS_ROLE, MS_SCHED_HOST, MS_SCHED_PORT (the ``ascendjob-port``),
    MS_NODE_RANK, MS_WORKER_NUM, MS_LOCAL_WORKER and MS_SERVER_NUM=0, and the workers
    ASCEND_VISIBLE_DEVICES; the launcher reads them (launcher/ascendjob.py).
    """
    sched = PodSettings(**{**pod.__dict__, "cpu": "2", "memory": "8Gi", "shm": "1Gi"})

    def replica(replicas: int, template: dict) -> dict:
        return {"replicas": replicas, "restartPolicy": "Never", "template": template}

    return {
        "apiVersion": "mindxdl.gitee.com/v1",
        "kind": "AscendJob",
        "metadata": {"name": name, "labels": {**LABELS, "framework": "mindspore",
                                              "fault-retry-times": str(max_retry)}},
        "spec": {
            "schedulerName": "volcano",
            "runPolicy": {"backoffLimit": max_retry,
                          "schedulingPolicy": {"minAvailable": nodes + 1, "queue": queue}},
            "successPolicy": "AllWorkers",
            "replicaSpecs": {
                "Scheduler": replica(1, pod_template(sched, ASCEND_CONTAINER, npus=False, port_name=ASCEND_PORT_NAME)),
                "Worker": replica(nodes, pod_template(pod, ASCEND_CONTAINER, port_name=ASCEND_PORT_NAME)),
            },
        },
    }


RENDERERS = {"volcano": volcano_job, "ascendjob": ascend_job}


def render_text(doc: dict, argv: list[str]) -> str:
    """YAML with a header saying how it was made."""
    head = (f"# Rendered by: python -m launcher render {' '.join(argv)}\n"
            "# Apply with: kubectl apply -f <this file>. Edit the env block or re-render to change it.\n")
    return head + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=100)


def parse_args(args: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="launcher render",
                                 description="Write a Kubernetes manifest for this job.")
    ap.add_argument("kind", choices=sorted(RENDERERS), help="volcano: a Volcano Job; ascendjob: an AscendJob")
    ap.add_argument("--nodes", type=int, default=1, help="Atlas 800T A2 nodes (NPROC_PER_NODE NPUs each, 8)")
    ap.add_argument("--image", default=DEFAULT_IMAGE, help="image reference the cluster can pull")
    ap.add_argument("--name", default="", help="job name (default: ascend-finetune-<recipe>)")
    ap.add_argument("--out", default="", help="file to write (default: stdout)")
    ap.add_argument("--queue", default="default", help="Volcano queue")
    ap.add_argument("--max-retry", type=int, default=3, help="whole-job restarts before it fails")
    ap.add_argument("--data-dir", default="/data",
                    help="shared storage mounted at this path in every pod (models, data, output)")
    ap.add_argument("--pvc", default="", help="PersistentVolumeClaim for --data-dir (default: hostPath)")
    ap.add_argument("--cpu", default="96", help="CPU request per node pod (192 cores on an 800T A2)")
    ap.add_argument("--memory", default="512Gi", help="memory request and limit per node pod, /dev/shm included")
    ap.add_argument("--shm", default="64Gi", help="size limit of the in-memory /dev/shm")
    return ap.parse_args(args)


def _dns_name(text: str, nodes: int) -> str:
    """A job name whose pod hostnames (<name>-worker-<i>) stay within the 63-character DNS label."""
    out = "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")
    limit = 63 - len(f"-{TASK}-{max(nodes - 1, 0)}")
    return "-".join(p for p in out.split("-") if p)[:limit].rstrip("-") or "ascend-finetune"


def main(args: list[str], env: Mapping[str, str] | None = None, overrides: list[str] | tuple = (),
         recipe_arg: str | None = None) -> int:
    """Entry for `python -m launcher render ...`; ``overrides``/``recipe_arg`` are the launcher's CLI items."""
    env = os.environ if env is None else env
    ns = parse_args(args)
    problems = []
    if ns.nodes < 1:
        problems.append(f"--nodes {ns.nodes}: at least 1 (e.g. --nodes 2)")
    if ns.max_retry < 0:
        problems.append(f"--max-retry {ns.max_retry}: 0 or more (e.g. --max-retry 3)")
    if not ns.data_dir.startswith("/"):
        problems.append(f"--data-dir {ns.data_dir!r}: an absolute path in the pod (e.g. --data-dir /data)")
    given = _given_recipe(env, list(overrides), recipe_arg) or "job"
    stem = Path(given).stem if given.endswith((".yaml", ".yml")) else Path(given).name
    name = _dns_name(ns.name or f"ascend-finetune-{stem}", ns.nodes)
    pod = pod_settings(ns, name, env, list(overrides), recipe_arg) if not problems else None
    problems += pod.problems if pod else []
    if problems:
        print("render: nothing written:\n" + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
        return 2
    assert pod is not None  # no problems: pod_settings ran
    for w in pod.warnings:
        print(f"render: warning: {w}", file=sys.stderr)
    text = render_text(RENDERERS[ns.kind](pod, ns.nodes, name, ns.queue, ns.max_retry), args)
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(text)
        print(f"render: wrote {ns.out} ({ns.kind}, {ns.nodes} node(s) x {pod.npus} NPUs)", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
