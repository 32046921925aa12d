"""Bad inputs, the rows of issue 31: each refused before anything starts (or read as meant), naming the setting,
its value and the fix. The cases run through test_bad_inputs.py's harness (``python -m launcher train``
in-process on a 2-CPU host, a stub as the job command): exit code, the strings named, no traceback, the stub
never ran, OUTPUT_DIR unchanged.
"""
from __future__ import annotations

import codecs
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from launcher_fakes import make_sys, recorded_npu_smi
from safetensors.numpy import save_file
from test_bad_inputs import _model
from test_bad_inputs import test_bad_input_is_refused_before_anything_starts as refused

import launcher.__main__ as lm
from jobspec.config import ConfigError
from jobspec.data.files import resolve_sources
from jobspec.data.formats import check_data, iter_samples
from jobspec.model_layout import full_shapes
from jobspec.recipe_load import load_recipe
from jobspec.tiny import ensure_tiny_model
from launcher import cluster
from launcher.model_check import adapter_problems, weight_problems


def _config(name: str, change: Callable[[dict], dict], init: dict | None = None):
    """A model dir whose config.json says otherwise than its weights: the tiny model (``init``: its config),
    then ``change`` applied to config.json alone."""
    def make(root: Path) -> None:
        d = root / name
        ensure_tiny_model(d, {"num_hidden_layers": 1, **(init or {})})
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(change(cfg)))
    return make


def _bytes(name: str, data: bytes):
    def make(root: Path) -> None:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return make


def _link(name: str, target: str):
    def make(root: Path) -> None:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).symlink_to(target)
    return make


def _text(name: str, text: str):
    return _bytes(name, text.encode())


RECORDS = [{"instruction": "Say hi to Zoë", "output": "hi"}, {"instruction": "Say bye", "output": "bye"}]
JSONL = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in RECORDS)

FIXTURES = (_model,
            _config("qwen25-as-qwen3", lambda c: {**c, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}),
            _config("qwen3-no-head-dim", lambda c: {k: v for k, v in c.items() if k != "head_dim"},
                    {"model_type": "qwen3", "head_dim": 32}),
            _config("untied", lambda c: {**c, "tie_word_embeddings": False}),
            _text("a.jsonl", '{"instruction": "Say hi", "output": "hi"}\n'),
            _link("loop-a", "loop-b"), _link("loop-b", "loop-a"),
            _text("loopcfg/tokenizer.json", "{}"), _link("loopcfg/config.json", "config.json"),
            _text("looped/good.jsonl", JSONL), _link("looped/more.jsonl", "more.jsonl"),
            _text("splits/README.md", "# a dataset card\n"), _text("splits/dataset_info.json", '{"features": {}}'),
            _text("splits/data/train-00000-of-00001.jsonl", JSONL), _text("splits/data/test-00000-of-00001.jsonl",
                                                                          JSONL),
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
    ("model-qwen25-weights-labelled-qwen3", {"MODEL_DIR": "{tmp}/qwen25-as-qwen3"}, [], 1,
     ["tensor model.layers.0.self_attn.q_norm.weight (shape [16]) is missing from the weights",
      "the weights have q/k/v biases and no q_norm / k_norm: Qwen2 / Qwen2.5 weights, but config.json says "
      "model_type qwen3", "use the config.json that came with these weights"]),
    ("model-qwen3-without-head-dim", {"MODEL_DIR": "{tmp}/qwen3-no-head-dim"}, [], 1,
     ["tensor model.layers.0.self_attn.q_proj.weight has shape [128, 64], config.json gives [64, 64]",
      "the weights' q_proj has head_dim 32 (128 rows / 4 heads); config.json has no head_dim (so hidden_size / "
      "num_attention_heads = 16)"]),
    ("model-untied-config-tied-weights", {"MODEL_DIR": "{tmp}/untied"}, [], 1,
     ["tensor lm_head.weight (shape [151936, 64]) is missing from the weights", "tie_word_embeddings"]),
    ("data-symlink-loop", {"DATA": "{tmp}/loop-a"}, [], 2,
     ["DATA='{tmp}/loop-a' (data.paths): {tmp}/loop-a is a symlink loop", "point it at the real file or directory"]),
    ("model-dir-symlink-loop", {"MODEL_DIR": "{tmp}/loop-b"}, [], 2,
     ["MODEL_DIR='{tmp}/loop-b' (model.dir): {tmp}/loop-b is a symlink loop"]),
    ("model-config-a-symlink-loop", {"MODEL_DIR": "{tmp}/loopcfg"}, [], 1,
     ["loopcfg: missing config.json (a broken symlink or loop), *.safetensors"]),
    ("data-dir-holding-a-symlink-loop", {"DATA": "{tmp}/looped"}, [], 1,
     ["looped/more.jsonl: a broken symlink or a symlink loop (data.paths[0]); fix the link, or remove it"]),
    ("data-hub-snapshot-with-a-test-split", {"DATA": "{tmp}/splits"}, [], 1,
     ["splits: holds a train split (train-00000-of-00001.jsonl) and held-out splits "
      "(test-00000-of-00001.jsonl)", "name the train files (e.g. DATA={tmp}/splits/data/train-00000-of-00001.jsonl)",
      "data.val_paths"]),
    ("lora-settings-with-full", {}, ["lora.r=4", "lora.alpha=32"], 2,
     ["train.method='full': lora.r=4, lora.alpha=32.0 set, but full fine-tuning trains every weight",
      "set train.method=lora, or drop the lora.* settings"]),
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


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16-le-bom", "utf-16-be-bom"])
@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_bom_or_utf16_file_is_read(tmp_path, encoding, suffix):
    text = JSONL if suffix == ".jsonl" else json.dumps(RECORDS, ensure_ascii=False)
    bom, codec = {"utf-8-sig": (codecs.BOM_UTF8, "utf-8"), "utf-16-le-bom": (codecs.BOM_UTF16_LE, "utf-16-le"),
                  "utf-16-be-bom": (codecs.BOM_UTF16_BE, "utf-16-be")}[encoding]
    f = tmp_path / f"data{suffix}"
    f.write_bytes(bom + text.encode(codec))
    samples = list(iter_samples(f))
    assert [s.turns[0][1] for s in samples] == ["Say hi to Zoë", "Say bye"]
    assert not any(s.bad_utf8 for s in samples)


def test_a_hub_snapshot_directory_reads_its_data_files(tmp_path):
    """huggingface-cli download of a dataset: README.md, dataset_info.json, .gitattributes, data/*.parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name, text in {"README.md": "# card", "dataset_info.json": '{"features": {}}', ".gitattributes": "*"}.items():
        (tmp_path / name).write_bytes(text.encode())
    (tmp_path / "data").mkdir()
    for i in range(2):
        pq.write_table(pa.Table.from_pylist(RECORDS), tmp_path / f"data/train-0000{i}-of-00002.parquet")
    r = load_recipe("tiny-cpu", {"data.paths": str(tmp_path)})
    assert [s.path.name for s in resolve_sources(r.data)] == ["train-00000-of-00002.parquet",
                                                              "train-00001-of-00002.parquet"]
    assert check_data(r.data) == []


def test_config_and_weights_of_one_model_agree(tmp_path):
    for i, init in enumerate(({}, {"model_type": "qwen3", "head_dim": 32}, {"tie_word_embeddings": False})):
        ensure_tiny_model(tmp_path / str(i), {"num_hidden_layers": 1, **init})
        cfg = json.loads((tmp_path / str(i) / "config.json").read_text())
        assert weight_problems(tmp_path / str(i), cfg, ["model.safetensors"]) == [], init


def _adapter(d: Path, base_cfg: dict, r: int = 4) -> Path:
    """A peft adapter (q_proj and v_proj of every layer) for a model of ``base_cfg``'s shapes, zeros."""
    shapes = full_shapes(base_cfg)
    tensors = {}
    for name, (out, fan_in) in ((n, s) for n, s in shapes.items() if n.endswith(("q_proj.weight", "v_proj.weight"))):
        module = "base_model.model." + name.removesuffix(".weight")
        tensors[module + ".lora_A.weight"] = np.zeros((r, fan_in), np.float32)
        tensors[module + ".lora_B.weight"] = np.zeros((out, r), np.float32)
    tensors["base_model.model.model.embed_tokens.weight"] = np.zeros(shapes["model.embed_tokens.weight"], np.float32)
    d.mkdir(parents=True)
    save_file(tensors, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 8,
                                                       "base_model_name_or_path": "/models/small"}))
    return d


def test_an_adapter_of_another_model_is_refused_before_loading(tmp_path, capsys):
    small, big = tmp_path / "small", tmp_path / "big"
    ensure_tiny_model(small, {"num_hidden_layers": 1})
    ensure_tiny_model(big, {"num_hidden_layers": 1, "hidden_size": 128, "intermediate_size": 256})
    adapter = _adapter(tmp_path / "adapter", json.loads((small / "config.json").read_text()))
    assert adapter_problems(adapter, small) == []
    (tmp_path / "dev").mkdir()
    host = lm.Host(env={"OUTPUT_DIR": str(tmp_path / "out")}, dev_dir=tmp_path / "dev", root=tmp_path,
                   npu_smi=None, identities=set(), sys_root=make_sys(tmp_path, {0: "0-1"}, cpuset_v2="0-1"))
    rc = lm.main(["generate", "--model-dir", str(big), "--adapter", str(adapter), "--prompt", "hi"], host)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert (f"{adapter}: base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight has shape [4, 64], but the "
            f"base {big} has model.layers.0.self_attn.q_proj.weight of shape [128, 128]") in err
    assert "this adapter belongs to another model (adapter_config.json: trained on /models/small); give " \
           "--model-dir that model" in err and "Traceback" not in err
    deeper = json.loads((small / "config.json").read_text()) | {"num_hidden_layers": 2}
    assert adapter_problems(_adapter(tmp_path / "deeper", deeper), small)[:2] == [
        f"{tmp_path / 'deeper'}: base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight has shape [4, 64], "
        f"but the base {small} has no model.layers.1.self_attn.q_proj.weight",
        f"{tmp_path / 'deeper'}: base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight has shape [64, 4], "
        f"but the base {small} has no model.layers.1.self_attn.q_proj.weight"]


def test_only_split_names_count_as_splits(tmp_path):
    for name in ("trainer.jsonl", "devops.jsonl", "valuable.jsonl"):
        (tmp_path / name).write_bytes(JSONL.encode())
    r = load_recipe("tiny-cpu", {"data.paths": str(tmp_path)})
    assert [s.path.name for s in resolve_sources(r.data)] == ["devops.jsonl", "trainer.jsonl", "valuable.jsonl"]
