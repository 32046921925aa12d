"""`python -m launcher render volcano --nodes N`: Kubernetes manifests for this image.

Writes a Volcano Job (``batch.volcano.sh/v1alpha1``) running N nodes x 8 NPUs of the image. The pod env
carries the job's settings (RECIPE, MODEL_DIR, DATA, OUTPUT_DIR, NNODES, NPROC_PER_NODE, OVERRIDES
and the pass-through variables) from the resolved recipe and the environment. No master address is
set here: in the pod the launcher finds it from what Volcano's svc/env plugins inject
(``VC_TASK_INDEX``, ``VC_WORKER_HOSTS``, ``/etc/volcano/worker.host``).

Pure Python (yaml only): the launcher imports it without MindSpore.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

import yaml

from finetune.config import Recipe

DEFAULT_IMAGE = "ascend-finetune:latest"
NPUS_PER_NODE = 8  # Atlas 800T A2
NPU_RESOURCE = "huawei.com/Ascend910"
ENTRYPOINT = "/opt/ascend-finetune/entrypoint.sh"
TASK = "worker"  # Volcano injects VC_WORKER_HOSTS / VC_WORKER_NUM for this task name
GRACE_SECONDS = 600  # time for the launcher to forward SIGTERM and the workers to save a checkpoint
MASTER_PORT = 8118
LABELS = {"app": "ascend-finetune", "ring-controller.atlas": "ascend-910b"}
# Host driver pieces the container needs (read-only): path -> hostPath type.
DRIVER_MOUNTS = {
    "/usr/local/Ascend/driver": "Directory",
    "/usr/local/dcmi": "Directory",
    "/usr/local/bin/npu-smi": "File",
    "/etc/ascend_install.info": "File",
}
# Environment passed through unchanged when set where render runs.
PASS_ENV = ("DATA_FORMAT", "TP", "PP", "DP", "NUMA_BIND", "MAX_RESTARTS", "MASTER_PORT",
            "HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT", "HCCL_IF_IP", "HCCL_SOCKET_IFNAME",
            "HCCL_BUFFSIZE")


def job_env(recipe: Recipe, nodes: int, env: Mapping[str, str]) -> list[dict]:
    """The pod's env list: the job settings from the recipe, overrides and pass-through vars."""
    values = {
        "RECIPE": env.get("RECIPE") or recipe.name,
        "MODEL_DIR": recipe.model.dir,
        "DATA": ",".join(recipe.data.paths),
        "OUTPUT_DIR": recipe.output_dir,
        "NNODES": str(nodes),
        "NPROC_PER_NODE": str(NPUS_PER_NODE),
        "OVERRIDES": env.get("OVERRIDES", ""),
    }
    values.update({k: env[k] for k in PASS_ENV if env.get(k)})
    return [{"name": k, "value": v} for k, v in values.items() if v]


def _volumes(data_dir: str, pvc: str) -> tuple[list[dict], list[dict]]:
    """(volumes, volumeMounts): /dev/shm in memory, the driver read-only, the shared data dir."""
    vols = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    for i, (path, kind) in enumerate(DRIVER_MOUNTS.items()):
        vols.append({"name": f"ascend-{i}", "hostPath": {"path": path, "type": kind}})
        mounts.append({"name": f"ascend-{i}", "mountPath": path, "readOnly": True})
    source = ({"persistentVolumeClaim": {"claimName": pvc}} if pvc
              else {"hostPath": {"path": data_dir, "type": "Directory"}})
    vols.append({"name": "data", **source})
    mounts.append({"name": "data", "mountPath": data_dir})
    return vols, mounts


def pod_template(recipe: Recipe, nodes: int, image: str, env: Mapping[str, str],
                 data_dir: str = "/data", pvc: str = "") -> dict:
    """One node's pod: 8 NPUs, the entrypoint, driver mounts, a checkpoint-sized grace period."""
    vols, mounts = _volumes(data_dir, pvc)
    npus = {NPU_RESOURCE: NPUS_PER_NODE}
    container = {
        "name": "finetune",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": [ENTRYPOINT],
        "args": ["train"],
        "env": job_env(recipe, nodes, env),
        "ports": [{"name": "master", "containerPort": int(env.get("MASTER_PORT") or MASTER_PORT)}],
        "resources": {"requests": dict(npus), "limits": dict(npus)},
        "volumeMounts": mounts,
    }
    return {
        "metadata": {"labels": dict(LABELS)},
        "spec": {
            "terminationGracePeriodSeconds": GRACE_SECONDS,
            "restartPolicy": "Never",
            "nodeSelector": {"accelerator-type": "module-910b-8"},
            "containers": [container],
            "volumes": vols,
        },
    }


def volcano_job(recipe: Recipe, nodes: int, image: str, name: str, env: Mapping[str, str],
                queue: str = "default", max_retry: int = 3, **volumes: str) -> dict:
    """A Volcano Job: gang-scheduled N pods, restarted whole on eviction, done when a task completes."""
    return {
        "apiVersion": "batch.volcano.sh/v1alpha1",
        "kind": "Job",
        "metadata": {"name": name, "labels": dict(LABELS)},
        "spec": {
            "schedulerName": "volcano",
            "queue": queue,
            "minAvailable": nodes,
            "maxRetry": max_retry,
            "plugins": {"svc": [], "env": []},
            "policies": [
                {"event": "PodEvicted", "action": "RestartJob"},
                {"event": "TaskCompleted", "action": "CompleteJob"},
            ],
            "tasks": [{
                "name": TASK,
                "replicas": nodes,
                "template": pod_template(recipe, nodes, image, env, **volumes),
            }],
        },
    }


RENDERERS = {"volcano": volcano_job}


def render_text(doc: dict, argv: list[str]) -> str:
    """YAML with a header saying how it was made."""
    head = (f"# Rendered by: python -m launcher render {' '.join(argv)}\n"
            "# Apply with: kubectl apply -f <this file>. Edit the env block or re-render to change it.\n")
    return head + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=100)


def parse_args(args: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="launcher render",
                                 description="Write a Kubernetes manifest for this job.")
    ap.add_argument("kind", choices=sorted(RENDERERS), help="volcano: a Volcano Job")
    ap.add_argument("--nodes", type=int, default=1, help="Atlas 800T A2 nodes (8 NPUs each)")
    ap.add_argument("--image", default=DEFAULT_IMAGE, help="image reference the cluster can pull")
    ap.add_argument("--name", default="", help="job name (default: ascend-finetune-<recipe>)")
    ap.add_argument("--out", default="", help="file to write (default: stdout)")
    ap.add_argument("--queue", default="default", help="Volcano queue")
    ap.add_argument("--max-retry", type=int, default=3, help="whole-job restarts before it fails")
    ap.add_argument("--data-dir", default="/data",
                    help="shared storage mounted at this path in every pod (models, data, output)")
    ap.add_argument("--pvc", default="", help="PersistentVolumeClaim for --data-dir (default: hostPath)")
    return ap.parse_args(args)


def _dns_name(text: str) -> str:
    out = "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")
    return "-".join(p for p in out.split("-") if p)[:63] or "ascend-finetune"


def main(args: list[str], recipe: Recipe, env: Mapping[str, str] | None = None) -> int:
    """Entry for `python -m launcher render ...`; ``recipe`` is the resolved recipe."""
    env = os.environ if env is None else env
    ns = parse_args(args)
    problems = []
    if ns.nodes < 1:
        problems.append(f"--nodes {ns.nodes}: at least 1 (e.g. --nodes 2)")
    if ns.max_retry < 0:
        problems.append(f"--max-retry {ns.max_retry}: 0 or more (e.g. --max-retry 3)")
    if not ns.data_dir.startswith("/"):
        problems.append(f"--data-dir {ns.data_dir!r}: an absolute path in the pod (e.g. --data-dir /data)")
    if problems:
        print("render: " + "; ".join(problems), file=sys.stderr)
        return 2
    name = _dns_name(ns.name or f"ascend-finetune-{recipe.name or 'job'}")
    doc = RENDERERS[ns.kind](recipe, ns.nodes, ns.image, name, env, queue=ns.queue,
                             max_retry=ns.max_retry, data_dir=ns.data_dir, pvc=ns.pvc)
    for var, value in (("MODEL_DIR", recipe.model.dir), ("DATA", recipe.data.paths)):
        if not value and recipe.model.init is None:
            print(f"render: warning: {var} is empty; set it (e.g. {var}=/data/...) before rendering",
                  file=sys.stderr)
    text = render_text(doc, args)
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(text)
        print(f"render: wrote {ns.out} ({ns.kind}, {ns.nodes} node(s) x {NPUS_PER_NODE} NPUs)", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
