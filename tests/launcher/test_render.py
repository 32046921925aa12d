"""launcher/render.py: Volcano Job and AscendJob manifests, checked against the vendored CRD schemas."""
from __future__ import annotations

import copy
import functools
import json
import socket
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from launcher_fakes import recorded_npu_smi

import launcher.__main__ as lm
from launcher import lock, render, settings

REPO = Path(__file__).resolve().parents[2]
CRDS = Path(__file__).parent / "fixtures" / "crds"  # vendored upstream CRDs (provenance in its README.md)
EXAMPLE = REPO / "deploy" / "volcano" / "qwen2.5-7b-2nodes.yaml"
# The inputs of the committed example (regenerate it with the same ones).
EXAMPLE_ARGS = ["volcano", "--nodes", "2", "--image", "registry.example.com/ascend-finetune:0.1.0",
                "--pvc", "sft-data", "--out", "deploy/volcano/qwen2.5-7b-2nodes.yaml"]
EXAMPLE_ENV = {"RECIPE": "qwen2.5-7b-full", "MODEL_DIR": "/data/models/Qwen2.5-7B-Instruct",
               "DATA": "/data/sft/train.jsonl", "OUTPUT_DIR": "/data/output/qwen2.5-7b-sft"}


def _strict(schema):
    """The CRD schema as JSON Schema: x-kubernetes-* dropped, unknown fields rejected.

    The API server prunes fields a structural schema does not know, so a typo would vanish
    silently there; here it fails the test instead.
    """
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    preserve = schema.get("x-kubernetes-preserve-unknown-fields")
    out = {k: _strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if "properties" in out and "additionalProperties" not in out and not preserve:
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_validator(filename: str) -> jsonschema.Draft7Validator:
    crd = yaml.load((CRDS / filename).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    schema = _strict(copy.deepcopy(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]))
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft7Validator(schema)


def rendered(tmp_path: Path, nodes: int, env: dict | None = None, extra: list[str] | None = None,
             kind: str = "volcano", overrides: list[str] | None = None) -> dict:
    out = tmp_path / f"{kind}{nodes}.yaml"
    args = [kind, "--nodes", str(nodes), "--out", str(out), *(extra or [])]
    assert render.main(args, env={**EXAMPLE_ENV, **(env or {})}, overrides=overrides or []) == 0
    return yaml.safe_load(out.read_text())


def refused(args: list[str], env: dict, capsys, overrides: list[str] | None = None) -> str:
    assert render.main(args, env=env, overrides=overrides or []) == 2
    return capsys.readouterr().err


def container(job: dict) -> dict:
    (task,) = job["spec"]["tasks"]
    (c,) = task["template"]["spec"]["containers"]
    return c


def env_of(c: dict) -> dict:
    return {e["name"]: e["value"] for e in c["env"]}


def planned(host: lm.Host, capsys, *args: str) -> dict:
    """`plan` on the host; the plan JSON it prints."""
    assert lm.main(["plan", *args], host) == 0
    text = capsys.readouterr().out
    return json.JSONDecoder().raw_decode(text[text.index("\n{") + 1:])[0]


def msrun_options(plan: dict) -> dict[str, str]:
    argv = plan["msrun_argv"]
    return {argv[i]: argv[i + 1] for i in range(1, len(argv) - 1) if argv[i].startswith("--")}


def errors(job: dict, crd: str) -> list[str]:
    return [f"{list(e.absolute_path)}: {e.message}" for e in crd_validator(crd).iter_errors(job)]


@pytest.mark.parametrize("nodes", [1, 2])
def test_volcano_job_validates_and_has_the_required_fields(tmp_path: Path, nodes: int) -> None:
    job = rendered(tmp_path, nodes, env={"OVERRIDES": "train.lr=1e-5 train.epochs=1", "HCCL_BUFFSIZE": "200"})
    assert not errors(job, "batch.volcano.sh_jobs.yaml")
    assert job["apiVersion"] == "batch.volcano.sh/v1alpha1" and job["kind"] == "Job"
    spec = job["spec"]
    assert spec["schedulerName"] == "volcano" and spec["minAvailable"] == nodes and spec["maxRetry"] >= 1
    assert set(spec["plugins"]) == {"svc", "env"}
    # pod 0's name resolves before it is Ready (else the others' DNS lookups of the master fail)
    assert spec["plugins"]["svc"] == ["--publish-not-ready-addresses=true"]
    assert {(p["event"], p["action"]) for p in spec["policies"]} == {
        ("PodFailed", "RestartJob"), ("PodEvicted", "RestartJob"), ("TaskCompleted", "CompleteJob")}
    (task,) = spec["tasks"]
    assert task["replicas"] == nodes and task["name"] == "worker"
    pod = task["template"]
    assert pod["metadata"]["labels"]["ring-controller.atlas"] == "ascend-910b"
    assert pod["spec"]["terminationGracePeriodSeconds"] >= 300
    c = container(job)
    assert c["command"] == ["/opt/ascend-finetune/entrypoint.sh"]
    assert c["securityContext"] == {"capabilities": {"add": ["SYS_NICE"]}}  # numactl --membind (launcher/numa.py)
    assert c["resources"] == {"requests": {"cpu": "96", "memory": "512Gi", "huawei.com/Ascend910": 8},
                              "limits": {"memory": "512Gi", "huawei.com/Ascend910": 8}}
    assert env_of(c) == {"RECIPE": "qwen2.5-7b-full", "MODEL_DIR": "/data/models/Qwen2.5-7B-Instruct",
                         "DATA": "/data/sft/train.jsonl",
                         "OUTPUT_DIR": "/data/output/qwen2.5-7b-sft", "NPROC_PER_NODE": "8",
                         "OVERRIDES": "train.lr=1e-5 train.epochs=1", "HCCL_BUFFSIZE": "200"}
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert vols[mounts["/dev/shm"]["name"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    for path in ("/usr/local/Ascend/driver", "/usr/local/dcmi", "/usr/local/bin/npu-smi",
                 "/etc/ascend_install.info"):
        assert mounts[path]["readOnly"] is True
        assert vols[mounts[path]["name"]]["hostPath"]["path"] == path
    assert vols[mounts["/data"]["name"]]["hostPath"]["path"] == "/data"


@pytest.mark.parametrize("pod", [0, 1])
def test_each_pod_of_the_rendered_job_plans_its_own_node(tmp_path: Path, atlas: Path, capsys, pod: int) -> None:
    """The rendered env plus what Volcano's env and svc plugins add on pod i (VC_TASK_INDEX=i, the hosts)."""
    job = rendered(tmp_path, 2)
    name = job["metadata"]["name"]
    hosts = [f"{name}-worker-{i}.{name}" for i in range(2)]
    pod_env = {**env_of(container(job)), "VC_TASK_INDEX": str(pod), "VK_TASK_INDEX": str(pod),
               "VC_WORKER_HOSTS": ",".join(hosts), "VC_WORKER_NUM": "2"}
    host = lm.Host(env=pod_env, dev_dir=atlas / "dev", root=atlas, sys_root=atlas / "sys",
                   npu_smi=recorded_npu_smi, identities={f"{name}-worker-{pod}", f"10.244.{pod}.7"})
    # output_dir: plan may write plan.json, and /data is the pods' volume, not this machine's
    plan = planned(host, capsys, f"output_dir={tmp_path}/o")
    t = plan["topology"]
    assert (t["nnodes"], t["node_rank"], t["master_addr"], t["world_size"]) == (2, pod, hosts[0], 16)
    assert plan["sources"]["cluster"].startswith("volcano:")
    assert msrun_options(plan)["--node_rank"] == str(pod)


def test_overrides_given_to_render_reach_the_manifest(tmp_path: Path) -> None:
    job = rendered(tmp_path, 2, overrides=["train.lr=1e-5", "TP=4", "data.seq_len=2048"])
    env = env_of(container(job))
    assert env["TP"] == "4" and env["OVERRIDES"] == "train.lr=1e-5 data.seq_len=2048"


@pytest.mark.parametrize("env,overrides,msg", [
    ({"NNODES": "2"}, [], "NNODES=2: the pods must not be given it; use --nodes N"),
    ({}, ["launch.master_addr=10.0.0.1"], "MASTER_ADDR=10.0.0.1: the pods must not be given it"),
    ({"OUTPUT_DIR": "./output"}, [], "OUTPUT_DIR=./output: not a path on the volume mounted at --data-dir /data"),
    ({"DATA": "/home/me/train.jsonl,/data/b.jsonl"}, [], "DATA=/home/me/train.jsonl: not a path on the volume"),
    ({}, ["model.dir=/srv/models/q"], "MODEL_DIR=/srv/models/q: not a path on the volume"),
    ({}, ["model.dir=/srv/models/q"], "e.g. MODEL_DIR=/data/models/Qwen2.5-7B-Instruct"),  # not a data file
    ({}, ["data.val_paths=/home/me/val.jsonl"], "data.val_paths=/home/me/val.jsonl: not a path on the volume"),
    ({"OVERRIDES": "launch.hostfile=/home/me/hosts"}, [], "HOSTFILE=/home/me/hosts: the pods must not be given it"),
    ({"RECIPE": "", "MODEL_DIR": "", "DATA": ""}, [], "no RECIPE, and MODEL_DIR and DATA are not both set: every pod "
                                                      "would run tiny-cpu (the tiny model on CPU) while holding NPUs"),
    ({"NPROC_PER_NODE": "9"}, [], "NPROC_PER_NODE=9: NPUs per pod, 1 to 8"),
    ({"MODEL_DIR": ""}, [], "MODEL_DIR is not set: recipe qwen2.5-7b-full needs"),
    ({}, ["train.lr=fast"], "train.lr"),
])
def test_what_cannot_work_in_a_pod_is_refused(env: dict, overrides: list, msg: str, capsys) -> None:
    err = refused(["volcano", "--nodes", "2"], {**EXAMPLE_ENV, **env}, capsys, overrides)
    assert msg in err and "nothing written" in err


def test_the_pods_recipe_follows_the_launchers_default_rule(tmp_path: Path) -> None:
    """MODEL_DIR and DATA given through OVERRIDES pick the NPU recipe, as train on an NPU host does."""
    job = rendered(tmp_path, 2, env={"RECIPE": "", "MODEL_DIR": "", "DATA": "",
                                     "OVERRIDES": "model.dir=/data/m data.paths=/data/a.jsonl"})
    assert env_of(container(job))["RECIPE"] == "qwen2.5-7b-full"
    assert settings.collect({"OVERRIDES": "model.dir=/m data.paths=/d"}, [], None, True).recipe == "qwen2.5-7b-full"


def test_overrides_with_spaces_reach_the_pods_quoted(tmp_path: Path) -> None:
    job = rendered(tmp_path, 1, overrides=['data.system_prompt=You are a pirate', "export.check_prompts="])
    text = env_of(container(job))["OVERRIDES"]
    assert settings.collect({"OVERRIDES": text}, [], None).overrides == {
        "data.system_prompt": "You are a pirate", "export.check_prompts": ""}


def test_a_recipe_file_of_this_machine_is_refused(tmp_path: Path, capsys) -> None:
    mine = tmp_path / "my.yaml"
    mine.write_text((REPO / "recipes" / "qwen2.5-7b-full.yaml").read_text())
    err = refused(["volcano"], {**EXAMPLE_ENV, "RECIPE": str(mine)}, capsys)
    assert f"RECIPE={mine}: a file of this machine" in err and "RECIPE=/data/recipes/my.yaml" in err
    ok = rendered(tmp_path, 1, env={"RECIPE": str(REPO / "recipes" / "qwen2.5-7b-full.yaml")})
    assert env_of(container(ok))["RECIPE"] == "qwen2.5-7b-full"  # a bundled recipe goes by its name


def test_nproc_per_node_sets_the_npu_request(tmp_path: Path) -> None:
    c = container(rendered(tmp_path, 2, env={"NPROC_PER_NODE": "4"}))
    assert c["resources"]["requests"]["huawei.com/Ascend910"] == 4 == c["resources"]["limits"]["huawei.com/Ascend910"]
    assert env_of(c)["NPROC_PER_NODE"] == "4"


def test_output_on_a_per_node_host_path_warns(tmp_path: Path, capsys) -> None:
    rendered(tmp_path, 2)
    assert "is a hostPath: each node has its own" in capsys.readouterr().err
    job = rendered(tmp_path, 2, extra=["--pvc", "sft-data"])
    assert "hostPath" not in capsys.readouterr().err
    assert env_of(container(job))["OVERRIDES"] == "data.shared_storage=true"


def test_pvc_name_and_default_output_dir(tmp_path: Path) -> None:
    env = {k: v for k, v in EXAMPLE_ENV.items() if k != "OUTPUT_DIR"}
    out = tmp_path / "j.yaml"
    assert render.main(["volcano", "--nodes", "2", "--pvc", "sft-data", "--data-dir", "/mnt/sft", "--name",
                        "My_Job.1", "--out", str(out)], env={**env, "MODEL_DIR": "/mnt/sft/m",
                                                             "DATA": "/mnt/sft/d.jsonl"}) == 0
    job = yaml.safe_load(out.read_text())
    assert job["metadata"]["name"] == "my-job-1"
    assert env_of(container(job))["OUTPUT_DIR"] == "/mnt/sft/output/my-job-1"
    vols = {v["name"]: v for v in job["spec"]["tasks"][0]["template"]["spec"]["volumes"]}
    assert vols["data"] == {"name": "data", "persistentVolumeClaim": {"claimName": "sft-data"}}
    assert not errors(job, "batch.volcano.sh_jobs.yaml")


def test_schema_check_catches_a_misspelled_field(tmp_path: Path) -> None:
    job = rendered(tmp_path, 1)
    job["spec"]["minAvailible"] = 1
    job["spec"]["policies"][0]["event"] = "PodGone"
    assert len(errors(job, "batch.volcano.sh_jobs.yaml")) == 2


@pytest.mark.parametrize("args", [["volcano", "--nodes", "0"], ["volcano", "--data-dir", "rel"]])
def test_bad_arguments_are_reported(args: list[str], capsys) -> None:
    assert "render: nothing written" in refused(args, EXAMPLE_ENV, capsys)


def test_committed_example_equals_a_fresh_render(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert render.main(EXAMPLE_ARGS, env=EXAMPLE_ENV) == 0
    assert (tmp_path / EXAMPLE_ARGS[-1]).read_text() == EXAMPLE.read_text(), \
        "deploy/volcano example is stale: re-render it (see EXAMPLE_ARGS in this test)"


ASCENDJOB_EXAMPLE = REPO / "deploy" / "ascendjob" / "qwen2.5-7b-2nodes.yaml"
OPERATOR_ENV = Path(__file__).parent / "fixtures" / "ascendjob"  # what ascend-operator adds (README there)


def replica_container(job: dict, kind: str) -> dict:
    (c,) = job["spec"]["replicaSpecs"][kind]["template"]["spec"]["containers"]
    return c


def test_ascendjob_validates_one_scheduler_without_npus_and_n_workers(tmp_path: Path) -> None:
    job = rendered(tmp_path, 2, kind="ascendjob")
    assert not errors(job, "mindxdl.gitee.com_ascendjobs.yaml")
    assert job["apiVersion"] == "mindxdl.gitee.com/v1" and job["kind"] == "AscendJob"
    assert job["metadata"]["labels"]["framework"] == "mindspore"
    spec = job["spec"]
    assert set(spec["replicaSpecs"]) == {"Scheduler", "Worker"}  # additionalProperties: the CRD names no keys
    assert spec["runPolicy"]["schedulingPolicy"]["minAvailable"] == 3 and spec["successPolicy"] == "AllWorkers"
    assert (spec["replicaSpecs"]["Scheduler"]["replicas"], spec["replicaSpecs"]["Worker"]["replicas"]) == (1, 2)
    sched, worker = replica_container(job, "Scheduler"), replica_container(job, "Worker")
    assert sched["name"] == worker["name"] == "ascend"  # the operator writes its env into this container only
    assert "huawei.com/Ascend910" not in sched["resources"]["requests"]
    assert worker["resources"]["requests"]["huawei.com/Ascend910"] == 8
    assert sched["ports"] == worker["ports"] == [{"name": "ascendjob-port", "containerPort": 8118}]
    assert env_of(sched) == env_of(worker)
    bad = copy.deepcopy(job)
    bad["spec"]["runPolicy"]["backoffLimt"] = 3
    assert len(errors(bad, "mindxdl.gitee.com_ascendjobs.yaml")) == 1


def test_committed_ascendjob_example_equals_a_fresh_render(tmp_path: Path, monkeypatch) -> None:
    args = ["ascendjob", *EXAMPLE_ARGS[1:-1], "deploy/ascendjob/qwen2.5-7b-2nodes.yaml"]
    monkeypatch.chdir(tmp_path)
    assert render.main(args, env=EXAMPLE_ENV) == 0
    assert (tmp_path / args[-1]).read_text() == ASCENDJOB_EXAMPLE.read_text(), "re-render deploy/ascendjob"


def operator_pod_env(kind: str, fixture: str) -> dict:
    job = yaml.safe_load(ASCENDJOB_EXAMPLE.read_text())
    return {**env_of(replica_container(job, kind)), **json.loads((OPERATOR_ENV / fixture).read_text())}


def test_ascendjob_scheduler_pod_runs_msrun_scheduler_only(tmp_path: Path, capsys) -> None:
    (tmp_path / "dev").mkdir()
    seen = tmp_path / "seen.json"
    stub = [sys.executable, "-c", f"import json, sys; json.dump(sys.argv, open({str(seen)!r}, 'w'))",
            "--config", str(tmp_path / "o" / "plan-scheduler.json")]
    host = lm.Host(env=operator_pod_env("Scheduler", "scheduler.json"), dev_dir=tmp_path / "dev", root=tmp_path,
                   sys_root=tmp_path / "sys", npu_smi=None, identities={"10.244.3.15"}, command=stub)
    out_dir = tmp_path / "o"
    plan = planned(host, capsys, f"output_dir={out_dir}")
    argv, opt = plan["msrun_argv"], msrun_options(plan)
    assert (opt["--worker_num"], opt["--local_worker_num"], opt["--master_addr"], opt["--master_port"]) == \
        ("16", "0", "10.244.3.15", "8118")
    assert argv[-1] == str(out_dir / "plan-scheduler.json") and plan["ranks"] == []
    assert plan["role"] == "scheduler" and plan["topology"]["nproc_per_node"] == 0  # the role says it, not nproc
    assert plan["recipe"]["launch"]["device"] == "cpu" and "scheduler only" in plan["sources"]["launch_mode"]
    with socket.socket() as s:  # a port free on this (shared) machine for the preflight port check
        s.bind(("", 0))
        port = f"launch.master_port={s.getsockname()[1]}"
    assert lm.main(["preflight", f"output_dir={out_dir}", port], host) == 0  # no NPU, no model, no data here
    rows = capsys.readouterr().out
    checks = [line.split()[1] for line in rows.splitlines()[1:] if line.split()[0] in ("ok", "warn", "fail")]
    assert checks == ["role", "network", "layout"] and "fail" not in rows
    worker0 = lock.acquire(out_dir, 0, 2)  # Worker pod 0 runs on the same shared OUTPUT_DIR
    assert lm.main(["train", f"output_dir={out_dir}", port], host) == 0
    lock.release(worker0)
    assert json.loads(seen.read_text())[1:] == ["--config", str(out_dir / "plan-scheduler.json")]
    assert json.loads((out_dir / "plan-scheduler.json").read_text())["topology"]["nproc_per_node"] == 0
    assert not (out_dir / "data").exists() and not (out_dir / "plan.json").exists()


def test_ascendjob_worker_pod_is_node_of_its_index(tmp_path: Path, atlas: Path, capsys) -> None:
    host = lm.Host(env=operator_pod_env("Worker", "worker-1.json"), dev_dir=atlas / "dev", root=atlas,
                   sys_root=atlas / "sys", npu_smi=recorded_npu_smi, identities={"10.244.5.9"})
    plan = planned(host, capsys, f"output_dir={tmp_path}/o")
    opt = msrun_options(plan)
    assert (opt["--worker_num"], opt["--local_worker_num"], opt["--master_addr"], opt["--node_rank"]) == \
        ("16", "8", "10.96.41.7", "1")  # the Service IP is not this pod: msrun starts no scheduler here
    assert plan["role"] == "worker"
    assert [r["device"] for r in plan["ranks"]] == list(range(8))  # ASCEND_VISIBLE_DEVICES=Ascend910-0,...
    assert [r["global_rank"] for r in plan["ranks"]] == list(range(8, 16))
