"""Bad inputs, the rows of issue 31: each refused before anything starts (or read as meant), naming the setting,
its value and the fix. The cases run through test_bad_inputs.py's harness (``python -m launcher train``
in-process on a 2-CPU host, a stub as the job command): exit code, the strings named, no traceback, the stub
never ran, OUTPUT_DIR unchanged.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from launcher_fakes import recorded_npu_smi
from test_bad_inputs import _model
from test_bad_inputs import test_bad_input_is_refused_before_anything_starts as refused

import launcher.__main__ as lm
from jobspec.config import ConfigError, load_recipe
from launcher import cluster


def _text(name: str, text: str):
    return lambda root: (root / name).write_text(text)


FIXTURES = (_model,
            _text("a.jsonl", '{"instruction": "Say hi", "output": "hi"}\n'),
            _text("het.txt", "node-a slots=8\nnode-b slots=4\n"),
            _text("mixed.txt", "node-a slots=2\nnode-b\n"))

# (id, env (values formatted with {tmp}), CLI items, exit code, strings the output must name)
CASES = [
    ("hostfile-heterogeneous-slots-node0", {"HOSTFILE": "{tmp}/het.txt", "NODE_RANK": "0"}, [], 2,
     ["het.txt: the nodes have different slots (node-a slots=8, node-b slots=4)", "the same number of workers",
      "'node-a slots=4' and 'node-b slots=4'"]),
    ("hostfile-heterogeneous-slots-node1", {"HOSTFILE": "{tmp}/het.txt", "NODE_RANK": "1"}, [], 2,
     ["het.txt: the nodes have different slots (node-a slots=8, node-b slots=4)"]),
    ("hostfile-slots-on-one-line-only", {"HOSTFILE": "{tmp}/mixed.txt", "NODE_RANK": "1"}, [], 2,
     ["mixed.txt: the nodes have different slots (node-a slots=2, node-b slots=(none))"]),
    ("data-trailing-comma", {"DATA": "{tmp}/a.jsonl,"}, [], 2,
     ["DATA='{tmp}/a.jsonl,' (data.paths): entry 2 of 2 is empty", "e.g. DATA={tmp}/a.jsonl)"]),
    ("data-doubled-comma-overrides", {"OVERRIDES": "data.paths={tmp}/a.jsonl,,{tmp}/a.jsonl"}, [], 2,
     ["OVERRIDES: data.paths='{tmp}/a.jsonl,,{tmp}/a.jsonl': entry 2 of 3 is empty"]),
    ("nproc-above-cpus", {"NPROC_PER_NODE": "9999"}, [], 2,
     ["NPROC_PER_NODE='9999' (launch.nproc_per_node): 9999 workers per node", "this node has 2 CPU(s)",
      "e.g. NPROC_PER_NODE=2"]),
    ("data-hf-url", {"DATA": "hf://datasets/yahma/alpaca-cleaned"}, [], 2,
     ["DATA='hf://datasets/yahma/alpaca-cleaned' (data.paths): hf://datasets/yahma/alpaca-cleaned is a URL",
      "huggingface-cli download --repo-type dataset yahma/alpaca-cleaned --local-dir /data/alpaca-cleaned",
      "e.g. DATA=/data/alpaca-cleaned"]),
    ("data-https-url", {"DATA": "https://example.com/sft/train.jsonl"}, [], 2,
     ["is a URL", "curl -L -o /data/train.jsonl https://example.com/sft/train.jsonl", "e.g. DATA=/data/train.jsonl"]),
    ("data-s3-url", {}, ["data.val_paths=s3://bucket/sft/val.jsonl"], 2,
     ["data.val_paths=", "aws s3 cp s3://bucket/sft/val.jsonl /data/val.jsonl"]),
    ("betas-yaml-list-bad-entry", {}, ["train.betas=[0.9,x]"], 2,
     ["train.betas=['0.9', 'x']: entry 'x': expected a finite number", "e.g. train.betas=0.9,0.999"]),
    ("lora-target-typo-in-a-yaml-list", {"RECIPE": "tiny-cpu-lora"}, ["lora.target_modules=[q_projj,v_proj]"], 2,
     ["unknown layer(s) q_projj;", "names are q_proj, k_proj, v_proj"]),
    ("lora-settings-with-full", {}, ["lora.r=4", "lora.alpha=32"], 2,
     ["train.method='full': lora.r=4, lora.alpha=32.0 set but train.method=full", "set train.method=lora, or drop "
      "the lora.* settings"]),
]


@pytest.fixture(scope="module")
def inputs(module_tmp) -> Path:
    for make in FIXTURES:
        make(module_tmp)
    return module_tmp


@pytest.mark.parametrize("name,env,cli,rc,names", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_before_anything_starts(name, env, cli, rc, names, inputs, tmp_path, capsys):
    refused(name, env, cli, rc, [n.format(tmp=inputs) for n in names], inputs, tmp_path, capsys)


def test_a_lora_typo_names_only_the_bad_entry():
    with pytest.raises(ConfigError) as e:
        load_recipe("tiny-cpu-lora", {"lora.target_modules": "[q_projj,v_proj]"})
    assert [p.split(";")[0] for p in e.value.problems] == \
        ["lora.target_modules=['q_projj', 'v_proj']: unknown layer(s) q_projj"]


def test_yaml_lists_on_the_command_line_are_lists():
    r = load_recipe("tiny-cpu-lora", {"train.betas": "[0.9, 0.95]", "lora.target_modules": "['q_proj', \"v_proj\"]"})
    assert r.train.betas == [0.9, 0.95] and r.lora.target_modules == ["q_proj", "v_proj"]


def test_an_mpi_style_hostfile_line_is_host_and_slots(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("node-a:2\nnode-b:2   # MPI's host:slots\n")
    c = cluster.detect({"NODE_RANK": "1", "HOSTFILE": str(hf)}, me=set())
    assert (c.nnodes, c.node_rank, c.master_addr, c.nproc_per_node, c.hosts) == (2, 1, "node-a", 2,
                                                                                 ["node-a", "node-b"])


def test_more_workers_than_npus_is_refused(atlas, tmp_path, capsys):
    host = lm.Host(env={"OUTPUT_DIR": str(tmp_path / "out"), "NPROC_PER_NODE": "16", "RECIPE": "qwen2.5-7b-full",
                        "MODEL_DIR": str(tmp_path)}, dev_dir=atlas / "dev", root=atlas, sys_root=atlas / "sys",
                   npu_smi=recorded_npu_smi, identities=set(), command=[sys.executable, "-c", "raise SystemExit(3)"])
    assert lm.main(["plan"], host) == 2
    assert "NPROC_PER_NODE='16' (launch.nproc_per_node): 16 workers per node" in capsys.readouterr().err
    assert not (tmp_path / "out" / "plan.json").exists()
