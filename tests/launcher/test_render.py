"""launcher/render.py: Volcano Job manifests, checked against the Volcano CRD's schema."""
from __future__ import annotations

import copy
import functools
from pathlib import Path

import jsonschema
import pytest
import yaml

from finetune.config import load_recipe
from launcher import render

REPO = Path(__file__).resolve().parents[2]
CRDS = Path(__file__).parent / "fixtures" / "crds"  # vendored upstream CRDs (provenance in its README.md)
EXAMPLE = REPO / "deploy" / "volcano" / "qwen2.5-7b-2nodes.yaml"
# The inputs of the committed example (regenerate it with the same ones).
EXAMPLE_ARGS = ["volcano", "--nodes", "2", "--image", "registry.example.com/ascend-finetune:0.1.0",
                "--out", "deploy/volcano/qwen2.5-7b-2nodes.yaml"]
EXAMPLE_ENV = {"RECIPE": "qwen2.5-7b-full", "MODEL_DIR": "/data/models/Qwen2.5-7B-Instruct",
               "DATA": "/data/sft/train.jsonl", "OUTPUT_DIR": "/data/output/qwen2.5-7b-sft"}


def example_recipe():
    return load_recipe(EXAMPLE_ENV["RECIPE"], {"model.dir": EXAMPLE_ENV["MODEL_DIR"],
                                               "data.paths": EXAMPLE_ENV["DATA"],
                                               "output_dir": EXAMPLE_ENV["OUTPUT_DIR"]})


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


@functools.lru_cache(maxsize=None)
def crd_validator(filename: str) -> jsonschema.Draft7Validator:
    crd = yaml.load((CRDS / filename).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    schema = _strict(copy.deepcopy(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]))
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft7Validator(schema)


def rendered(tmp_path: Path, nodes: int, env: dict | None = None, extra: list[str] | None = None) -> dict:
    out = tmp_path / f"job{nodes}.yaml"
    args = ["volcano", "--nodes", str(nodes), "--out", str(out), *(extra or [])]
    assert render.main(args, example_recipe(), env={**EXAMPLE_ENV, **(env or {})}) == 0
    return yaml.safe_load(out.read_text())


@pytest.mark.parametrize("nodes", [1, 2])
def test_volcano_job_validates_and_has_the_required_fields(tmp_path: Path, nodes: int) -> None:
    job = rendered(tmp_path, nodes, env={"OVERRIDES": "train.lr=1e-5 train.epochs=1", "HCCL_BUFFSIZE": "200"})
    errors = sorted(crd_validator("batch.volcano.sh_jobs.yaml").iter_errors(job), key=str)
    assert not errors, [f"{list(e.absolute_path)}: {e.message}" for e in errors]
    assert job["apiVersion"] == "batch.volcano.sh/v1alpha1" and job["kind"] == "Job"
    spec = job["spec"]
    assert spec["schedulerName"] == "volcano" and spec["minAvailable"] == nodes and spec["maxRetry"] >= 1
    assert set(spec["plugins"]) == {"svc", "env"}
    assert {(p["event"], p["action"]) for p in spec["policies"]} >= {
        ("PodEvicted", "RestartJob"), ("TaskCompleted", "CompleteJob")}
    (task,) = spec["tasks"]
    assert task["replicas"] == nodes and task["name"] == "worker"
    pod = task["template"]
    assert pod["metadata"]["labels"]["ring-controller.atlas"] == "ascend-910b"
    assert pod["spec"]["terminationGracePeriodSeconds"] >= 300
    (c,) = pod["spec"]["containers"]
    assert c["command"] == ["/opt/ascend-finetune/entrypoint.sh"]
    assert c["resources"]["requests"]["huawei.com/Ascend910"] == 8
    assert c["resources"]["limits"]["huawei.com/Ascend910"] == 8
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env == {"RECIPE": "qwen2.5-7b-full", "MODEL_DIR": "/data/models/Qwen2.5-7B-Instruct",
                   "DATA": "/data/sft/train.jsonl", "OUTPUT_DIR": "/data/output/qwen2.5-7b-sft",
                   "NNODES": str(nodes), "NPROC_PER_NODE": "8",
                   "OVERRIDES": "train.lr=1e-5 train.epochs=1", "HCCL_BUFFSIZE": "200"}
    assert "MASTER_ADDR" not in env and "NODE_RANK" not in env  # the launcher reads Volcano's env
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert vols[mounts["/dev/shm"]["name"]]["emptyDir"] == {"medium": "Memory"}
    for path in ("/usr/local/Ascend/driver", "/usr/local/dcmi", "/usr/local/bin/npu-smi",
                 "/etc/ascend_install.info"):
        assert mounts[path]["readOnly"] is True
        assert vols[mounts[path]["name"]]["hostPath"]["path"] == path
    assert vols[mounts["/data"]["name"]]["hostPath"]["path"] == "/data"


def test_pvc_and_name_options(tmp_path: Path) -> None:
    job = rendered(tmp_path, 2, extra=["--pvc", "sft-data", "--data-dir", "/mnt/sft", "--name", "My_Job.1"])
    assert job["metadata"]["name"] == "my-job-1"
    vols = {v["name"]: v for v in job["spec"]["tasks"][0]["template"]["spec"]["volumes"]}
    assert vols["data"] == {"name": "data", "persistentVolumeClaim": {"claimName": "sft-data"}}
    assert not list(crd_validator("batch.volcano.sh_jobs.yaml").iter_errors(job))


def test_schema_check_catches_a_misspelled_field(tmp_path: Path) -> None:
    job = rendered(tmp_path, 1)
    job["spec"]["minAvailible"] = 1
    job["spec"]["policies"][0]["event"] = "PodGone"
    errors = list(crd_validator("batch.volcano.sh_jobs.yaml").iter_errors(job))
    assert len(errors) == 2


@pytest.mark.parametrize("args", [["volcano", "--nodes", "0"], ["volcano", "--data-dir", "rel"]])
def test_bad_arguments_are_reported(args: list[str], capsys) -> None:
    assert render.main(args, example_recipe(), env={}) == 2
    assert "render:" in capsys.readouterr().err


def test_committed_example_equals_a_fresh_render(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert render.main(EXAMPLE_ARGS, example_recipe(), env=EXAMPLE_ENV) == 0
    assert (tmp_path / EXAMPLE_ARGS[-1]).read_text() == EXAMPLE.read_text(), \
        "deploy/volcano example is stale: re-render it (see EXAMPLE_ARGS in this test)"
