"""Cluster detection: one table row per source, with the exact variables each scheduler injects."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from msrun_helpers import free_port

from jobspec.rundir import RunDir
from launcher import ascendjob, cluster, launch
from launcher.plan import Plan, Topology

ME = {"job-worker-1", "job-worker-1.job", "10.0.0.12"}

CASES = [
    # (name, env, expected source, nnodes, node_rank, master_addr, master_port, nproc_per_node)
    ("explicit", {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.11", "MASTER_PORT": "8118"},
     "env", None, None, None, None, None),
    ("volcano-one-task", {  # Volcano env + svc plugins, task "worker" with 2 replicas
        "VC_TASK_INDEX": "1", "VK_TASK_INDEX": "1", "VC_WORKER_HOSTS": "job-worker-0.job,job-worker-1.job",
        "VC_WORKER_NUM": "2", "MASTER_PORT": "8118"}, "volcano", 2, 1, "job-worker-0.job", 8118, None),
    ("volcano-master-and-workers", {  # two tasks: the index counts inside "worker" only
        "VC_TASK_INDEX": "0", "VC_MASTER_HOSTS": "job-master-0.job", "VC_MASTER_NUM": "1",
        "VC_WORKER_HOSTS": "job-worker-0.job,job-worker-1.job", "VC_WORKER_NUM": "2"},
     "volcano", 3, 2, "job-master-0.job", None, None),
    ("ascendjob", {  # AscendJob (MindX DL), framework mindspore: 2 pods x 8 NPUs
        "MS_SCHED_HOST": "10.0.0.11", "MS_SCHED_PORT": "29500", "MS_WORKER_NUM": "16", "MS_LOCAL_WORKER": "8",
        "MS_NODE_RANK": "1", "MS_ROLE": "MS_WORKER", "MS_SERVER_NUM": "0"},
     "ascendjob", 2, 1, "10.0.0.11", 29500, 8),
    ("kubeflow-pytorchjob", {  # PyTorchJob: WORLD_SIZE/RANK count pods; PET_* for torchrun
        "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "4", "RANK": "3",
        "PET_NNODES": "4", "PET_NODE_RANK": "3", "PET_NPROC_PER_NODE": "8"},
     "torchrun", 4, 3, "job-master-0", 23456, 8),
    ("torchrun-plain", {"MASTER_ADDR": "10.0.0.11", "MASTER_PORT": "29400", "WORLD_SIZE": "2", "RANK": "1"},
     "torchrun", 2, 1, "10.0.0.11", 29400, None),
    ("none", {"HOME": "/root"}, "single", 1, 0, "127.0.0.1", None, None),
]


@pytest.mark.parametrize("name,env,source,nnodes,rank,addr,port,nproc", CASES, ids=[c[0] for c in CASES])
def test_sources(name, env, source, nnodes, rank, addr, port, nproc, tmp_path):
    c = cluster.detect(env, me=ME, volcano_dir=tmp_path / "none")
    assert c.source == source and c.reason
    if nnodes is None:  # explicit env: the values reach the recipe through the env contract itself
        assert c.overrides() == {}
        return
    assert (c.nnodes, c.node_rank, c.master_addr, c.master_port, c.nproc_per_node) == (nnodes, rank, addr, port, nproc)


def test_volcano_host_files(tmp_path):
    vc = tmp_path / "volcano"
    vc.mkdir()
    (vc / "worker.host").write_text("job-worker-0.job\njob-worker-1.job\n")
    c = cluster.detect({"VC_TASK_INDEX": "1"}, me=ME, volcano_dir=vc)
    assert (c.source, c.nnodes, c.node_rank, c.master_addr) == ("volcano", 2, 1, "job-worker-0.job")


def test_volcano_without_svc_plugin_says_so(tmp_path):
    with pytest.raises(cluster.ClusterError, match="enable the svc plugin"):
        cluster.detect({"VC_TASK_INDEX": "0"}, me=ME, volcano_dir=tmp_path)


def test_ascendjob_waits_for_completed_rank_table(tmp_path):
    table = tmp_path / "hccl.json"
    table.write_text(json.dumps({"status": "initializing"}))
    sleeps = []

    def sleep(s):  # the operator finishes writing after two polls
        sleeps.append(s)
        if len(sleeps) == 2:
            table.write_text(json.dumps({"status": "completed", "server_count": "2"}))

    env = dict(CASES[3][1], RANK_TABLE_FILE=str(table))
    c = cluster.detect(env, me=ME, sleep=sleep)
    assert c.source == "ascendjob" and len(sleeps) == 2 and c.rank_table == str(table)


def test_ascendjob_rank_table_timeout(tmp_path):
    table = tmp_path / "hccl.json"
    table.write_text(json.dumps({"status": "initializing"}))
    env = dict(CASES[3][1], RANK_TABLE_FILE=str(table))
    with pytest.raises(cluster.ClusterError, match="status not 'completed'"):
        cluster.detect(env, me=ME, rank_table_timeout_s=0, sleep=lambda s: None)


def test_hostfile_finds_this_node_by_address(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("# two Atlas 800T A2\n10.0.0.11 slots=8\n\n10.0.0.12 slots=8  # this one\n")
    c = cluster.detect({}, hostfile=str(hf), me=ME)
    assert (c.source, c.nnodes, c.node_rank, c.master_addr, c.nproc_per_node) == ("hostfile", 2, 1, "10.0.0.11", 8)
    assert c.overrides()["launch.node_rank"] == "1"


def test_hostfile_errors_name_line_and_fix(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("node-a slots=8\nnode-b cores=8\n")
    with pytest.raises(cluster.ClusterError, match=r"hosts:2: 'cores=8' is not 'slots=N'"):
        cluster.detect({}, hostfile=str(hf), me=ME)
    hf.write_text("node-a slots=8\nnode-b slots=8\n")
    with pytest.raises(cluster.ClusterError, match="none of its hosts .* is this machine"):
        cluster.detect({}, hostfile=str(hf), me=ME)


def test_explicit_env_beats_scheduler_variables():
    env = {"NNODES": "1", "VC_TASK_INDEX": "0", "VC_WORKER_HOSTS": "a,b", "MS_SCHED_HOST": "x", "MS_WORKER_NUM": "8"}
    assert cluster.detect(env, me=ME).source == "env"


def test_shipped_hostfiles():
    from jobspec.config import REPO_ROOT
    two = cluster.detect({}, hostfile=str(REPO_ROOT / "hostfiles/two-nodes.txt"), me={"192.168.10.12"})
    assert (two.nnodes, two.node_rank, two.master_addr, two.nproc_per_node) == (2, 1, "192.168.10.11", 8)
    one = cluster.detect({}, hostfile=str(REPO_ROOT / "hostfiles/one-node.txt"), me={"localhost"})
    assert (one.nnodes, one.node_rank, one.nproc_per_node) == (1, 0, 8)


def test_explicit_multi_node_needs_this_nodes_rank():
    """Without NODE_RANK every node would plan itself node 0: refused, with the flag that fixes it."""
    with pytest.raises(cluster.ClusterError, match=r"-e NODE_RANK=1"):
        cluster.detect({"NNODES": "2", "MASTER_ADDR": "10.0.0.1"}, me=ME)
    assert cluster.detect({"NNODES": "2", "MASTER_ADDR": "10.0.0.1", "NODE_RANK": "1"}, me=ME).source == "env"


def test_ascendjob_roles():
    sched = dict(CASES[3][1], MS_ROLE="MS_SCHED", MS_NODE_RANK="0", MS_SCHED_HOST="10.244.3.15")
    assert cluster.detect(sched, me=ME).role == "scheduler"
    assert cluster.detect(CASES[3][1], me=ME).role == "worker"
    with pytest.raises(cluster.ClusterError, match="MS_ROLE='MS_PSERVER': expected MS_SCHED or MS_WORKER"):
        cluster.detect(dict(CASES[3][1], MS_ROLE="MS_PSERVER"), me=ME)


@pytest.mark.slow
def test_scheduler_pod_msrun_argv_starts_the_scheduler_alone(tmp_path):
    """Real msrun 2.10 with the Scheduler pod's argv (master 127.0.0.1 standing in for the pod IP)."""
    stub = tmp_path / "stub.py"
    stub.write_text("import os\nopen(os.environ['ROLES'], 'a').write(os.environ['MS_ROLE'] + ' ' + "
                    "os.environ['MS_WORKER_NUM'] + '\\n')\n")
    env = dict(CASES[3][1], MS_ROLE="MS_SCHED", MS_NODE_RANK="0", MS_SCHED_HOST="127.0.0.1",
               MS_SCHED_PORT=str(free_port()))
    clus = cluster.detect(env, me=ME)
    worker = Plan({"launch": {}, "train": {}}, Topology(2, 0, 8, 16, clus.master_addr, clus.master_port),
                  tmp_path / "plan.json", RunDir(tmp_path), 600)
    plan, _ = ascendjob.scheduler_only(worker, {}, clus)
    argv = [*plan.argv[:plan.argv.index("--cluster_time_out") + 2], str(stub)]
    run = subprocess.run(argv, cwd=tmp_path, env={**os.environ, "ROLES": str(tmp_path / "roles")}, timeout=300,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "roles").read_text() == "MS_SCHED 16\n"  # one process: the scheduler, no worker
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["scheduler.log"]


def test_supervise_waits_for_a_scheduler_only_msrun(tmp_path):
    """No local ranks (the AscendJob Scheduler pod): the job lasts as long as msrun, not a finish grace."""
    done = tmp_path / "done"
    argv = [sys.executable, "-c", f"import pathlib, time; time.sleep(1.0); pathlib.Path({str(done)!r}).touch()"]
    rc = launch.supervise(argv, dict(os.environ), tmp_path / "logs", 0, log=lambda m: None, under_msrun=True,
                          ranks=range(0), poll_s=0.05, finish_grace_s=0.2)
    assert rc == 0 and done.exists()
