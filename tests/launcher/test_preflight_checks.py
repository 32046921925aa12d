"""Each preflight check failing on purpose, plus an all-ok Atlas node."""
from __future__ import annotations

import json
import os
import shutil
import socket
import struct
from collections import namedtuple
from pathlib import Path

import pytest
from launcher_fakes import make_dev, recorded_npu_smi

from jobspec.config import ASSETS_DIR
from jobspec.memory import MemoryEstimate
from jobspec.model_layout import full_shapes
from jobspec.recipe_load import load_recipe
from launcher import devices, preflight

QWEN7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
          "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
          "vocab_size": 152064, "tie_word_embeddings": False}


def model_dir(root: Path, cfg=QWEN7B, shards=("model-00001-of-00002.safetensors",
                                                 "model-00002-of-00002.safetensors"), present=None) -> Path:
    d = root / "model"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    shutil.copyfile(ASSETS_DIR / "tokenizer/tokenizer.json", d / "tokenizer.json")  # the real Qwen2.5 tokenizer
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {f"w{i}": s for i, s in enumerate(shards)}}))
    for s in (shards if present is None else present):
        (d / s).write_bytes(header_only(cfg) if s == shards[0] else EMPTY_SAFETENSORS)
    return d


EMPTY_SAFETENSORS = struct.pack("<Q", 2) + b"{}"  # a valid safetensors file holding no tensors


def header_only(cfg: dict) -> bytes:
    """A safetensors header naming every tensor of ``cfg`` with no data (preflight reads the headers only)."""
    head = json.dumps({n: {"dtype": "BF16", "shape": list(s), "data_offsets": [0, 0]}
                       for n, s in full_shapes(cfg).items()}).encode()
    return struct.pack("<Q", len(head)) + head


TINY = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True}


def ctx(root: Path, npu: bool = True, nproc: int = 8, cfg: dict = QWEN7B, nnodes: int = 1,
        **over) -> preflight.Context:
    data = root / "train.jsonl"
    data.write_text('{"instruction": "hi", "output": "hello"}\n')
    o = {"model.dir": str(model_dir(root, cfg)), "data.paths": str(data), "output_dir": str(root / "out"),
         **({"parallel.tp": "2"} if npu else {}), **over}  # the NPU recipe's auto is the launcher's
    recipe = load_recipe("qwen2.5-7b-full" if npu else "tiny-cpu", o).resolved(nnodes * nproc, "npu" if npu else "cpu")
    if npu and not (root / "dev").exists():
        make_dev(root)
    devs = devices.probe(root / "dev", root, {}, recorded_npu_smi if npu else None)
    return preflight.Context(recipe, devs, nproc, root=root, data_checker=lambda cfg: [],
                             port_free=lambda port: True)


def rows(c, name):
    return [r for r in preflight.run_checks(c) if r.name == name]


def fails(c, name):
    return [r for r in rows(c, name) if r.status == "fail"]


def test_cpu_host_all_ok(tmp_path):
    c = ctx(tmp_path, npu=False, nproc=1, cfg=TINY)
    bad = [r for r in preflight.run_checks(c) if r.status == "fail"]
    assert not bad, preflight.table(bad)


def test_atlas_node_all_ok(atlas, monkeypatch):
    Stat = namedtuple("Stat", "f_blocks f_frsize")
    monkeypatch.setattr(preflight.os, "statvfs", lambda p: Stat(64 * 2**30 // 4096, 4096))
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: (0, 0, 10**13))
    c = ctx(atlas)
    c.memory_estimator = lambda cfg, **kw: MemoryEstimate(*(5 * 2**30,) * 6)
    table = preflight.table(preflight.run_checks(c))
    assert not preflight.failed(preflight.run_checks(c)), table
    assert "driver 25.2.0 runs the image's CANN 8.5.0" in table


def test_devices_fail_npu_recipe_without_npu(tmp_path):
    c = ctx(tmp_path, npu=False)
    c.recipe.launch.device = "npu"
    (r,) = fails(c, "devices")
    assert "needs NPUs" in r.detail and "--device=/dev/davinci0" in r.fix


def test_devices_fail_missing_management_device(atlas):
    (atlas / "dev/hisi_hdc").unlink()
    c = ctx(atlas)
    (r,) = fails(c, "mounts")
    assert (r.detail, r.fix) == ("device node /dev/hisi_hdc is absent", "docker run --device=/dev/hisi_hdc")


def test_devices_fail_permission(atlas, monkeypatch):
    monkeypatch.setattr(preflight.os, "access", lambda p, mode: False)
    assert any("permission" in r.detail and "HwHiAiUser" in r.fix for r in fails(ctx(atlas), "devices"))


def test_driver_and_cann_missing(tmp_path):
    c = ctx(tmp_path)  # /dev has NPUs but no driver tree
    assert fails(c, "driver")[0].fix == \
        "docker run ... -v /usr/local/Ascend/driver/version.info:/usr/local/Ascend/driver/version.info:ro"
    assert "ascend_toolkit_install.info" in fails(c, "CANN")[0].detail


def test_shm_too_small(tmp_path, monkeypatch):
    Stat = namedtuple("Stat", "f_blocks f_frsize")
    monkeypatch.setattr(preflight.os, "statvfs", lambda p: Stat(64 * 2**20 // 4096, 4096))  # docker's 64 MB
    (r,) = fails(ctx(tmp_path, npu=False, nproc=2), "/dev/shm")
    assert "--ipc=host" in r.fix


def test_disk_too_small(tmp_path, monkeypatch):
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: (0, 0, 50 * 2**30))
    (r,) = fails(ctx(tmp_path, npu=False), "disk")
    assert "7.6" in r.detail or "7.7" in r.detail  # Qwen2.5-7B: ~7.6 B parameters
    assert "OUTPUT_DIR" in r.fix


def test_disk_counts_the_checkpoint_being_written_and_the_export(tmp_path, monkeypatch):
    """7.6 B params, keep 2: three checkpoints of 16 B/param exist at the peak, plus the bf16 export (~355 GiB)."""
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: (0, 0, 300 * 2**30))
    (r,) = fails(ctx(tmp_path, npu=False, **{"train.keep_checkpoints": "2", "export.dtype": "bf16"}), "disk")
    assert "x 3 checkpoints (keep_checkpoints 2 + the one being written) + export" in r.detail
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: (0, 0, 400 * 2**30))
    assert not fails(ctx(tmp_path, npu=False, **{"train.keep_checkpoints": "2", "export.dtype": "bf16"}), "disk")


def test_a_lora_run_needs_disk_for_its_adapters_checkpoints_and_the_merged_export_only(tmp_path, monkeypatch):
    """LoRA checkpoints hold the adapters (finetune/io/checkpoint.py saves the trained parameters): Qwen2.5-7B at
    r 8 trains 20.2 M parameters, so 3 checkpoints are about 1 GiB and the merged bf16 hf/ 14.2 GiB, not the
    full fine-tune's 355 GiB, which a 100 GiB volume was refused for."""
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: (0, 0, 100 * 2**30))
    lora = {"train.method": "lora", "train.keep_checkpoints": "2", "export.dtype": "bf16"}
    assert fails(ctx(tmp_path, npu=False, **{**lora, "train.method": "full"}), "disk")
    (r,) = rows(ctx(tmp_path, npu=False, **lora), "disk")
    assert r.status == "ok" and "20.2 M trained (LoRA) params x 16 B x 3 checkpoints" in r.detail
    assert "need ~15.2 GiB" in r.detail
    (r,) = rows(ctx(tmp_path, npu=False, **lora, **{"export.merge": "false"}), "disk")
    assert "need ~1.0 GiB" in r.detail  # adapter/ alone: no merged hf/
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: (0, 0, 10 * 2**30))
    (r,) = fails(ctx(tmp_path, npu=False, **lora), "disk")
    assert "OUTPUT_DIR" in r.fix


def test_param_count_qwen7b():
    assert 7.5e9 < preflight.param_count(QWEN7B) < 7.7e9


def test_model_missing_shard_and_tokenizer(tmp_path):
    c = ctx(tmp_path, npu=False)
    d = model_dir(tmp_path / "m2", present=["model-00001-of-00002.safetensors"])
    (d / "tokenizer.json").unlink()
    c.recipe.model.dir, c.recipe.model.init = str(d), None
    (r,) = fails(c, "model")
    assert "tokenizer.json" in r.detail and "model-00002-of-00002.safetensors" in r.detail


def test_model_dir_unset(tmp_path):
    c = ctx(tmp_path, npu=False)
    c.recipe.model.dir, c.recipe.model.init = "", None
    assert "MODEL_DIR=" in fails(c, "model")[0].fix


def test_data_missing_and_unparseable(tmp_path):
    c = ctx(tmp_path, npu=False)
    c.recipe.data.paths = [str(tmp_path / "nope.json")]
    assert "nope.json" in fails(c, "data")[0].detail
    c = ctx(tmp_path, npu=False)
    c.data_checker = lambda cfg: [f"{cfg.paths[0]}:1: field 'output' missing; add it"]
    assert "field 'output' missing" in fails(c, "data")[0].detail


def test_memory_over_budget_suggests_layout(atlas):
    c = ctx(atlas, **{"parallel.tp": "1"})

    def est(cfg, *, tp, **kw):  # fits only with TP >= 2
        return MemoryEstimate(*((90 if tp == 1 else 40) * 2**30 // 6,) * 6)
    c.memory_estimator = est
    (r,) = fails(c, "memory")
    assert "64.0 GiB NPU HBM" in r.detail and r.fix.startswith("use TP=2")


def test_memory_suggestion_is_auto_s_choice_and_a_layout_of_this_model(tmp_path):
    """The suggested TP is the one parallel.tp=auto would take (jobspec.layout_choice.choose_layout, whose tp_problems
    the layout check uses): 24 query heads but 3 KV heads, so TP 2, 4 and 8 split no KV head evenly however
    much memory they would save (the suggestion once checked only the query heads: 'use TP=2')."""
    cfg = dict(QWEN7B, hidden_size=3072, num_attention_heads=24, num_key_value_heads=3)
    c = ctx(tmp_path, cfg=cfg, **{"parallel.tp": "1"})
    c.memory_estimator = lambda cfg, *, tp, **kw: MemoryEstimate(*((90 if tp < 2 else 20) * 2**30 // 6,) * 6)
    (r,) = fails(c, "memory")
    assert r.fix == "add nodes (NNODES) or a smaller model"


def test_memory_suggestion_with_compiled_layers_turns_them_off(tmp_path):
    """The suggested layout recomputes, which compiled layers refuse: the fix says to turn them off."""
    c = ctx(tmp_path, npu=False, nproc=1, cfg=TINY, **{"train.compile_layers": "true"})
    c.memory_estimator = lambda cfg, *, recompute, **kw: MemoryEstimate(*((1 if recompute else 10**6) * 2**30,) * 6)
    (r,) = fails(c, "memory")
    assert r.fix == ("use TP=1 OVERRIDES='train.micro_batch_size=1 train.recompute=true parallel.shard_optimizer=true "
                     "train.compile_layers=false' (6.0 GiB per device)")


def test_network_master_port_busy(tmp_path):
    c = ctx(tmp_path, npu=False, **{"launch.nnodes": "2", "launch.master_addr": "10.0.0.1"})
    c.port_free = lambda port: False
    assert "MASTER_PORT" in fails(c, "network")[0].fix


def test_network_master_unresolvable(tmp_path):
    c = ctx(tmp_path, npu=False, **{"launch.nnodes": "2", "launch.node_rank": "1",
                                     "launch.master_addr": "no-such-host.invalid"})

    def connect(host, port, t):
        raise socket.gaierror(-2, "Name or service not known")
    c.connect = connect
    assert "does not resolve" in fails(c, "network")[0].detail


def test_network_real_port_probe(tmp_path):
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen(1)
        port = s.getsockname()[1]
        c = ctx(tmp_path, npu=False, **{"launch.nnodes": "2", "launch.master_addr": "10.0.0.1",
                                         "launch.master_port": str(port)})
        c.port_free = None
        assert "in use" in fails(c, "network")[0].detail
        c = ctx(tmp_path, npu=False, **{"launch.nnodes": "2", "launch.node_rank": "1",
                                         "launch.master_addr": socket.gethostname(), "launch.master_port": str(port)})
        assert [r.status for r in rows(c, "network")] == ["ok"]


@pytest.mark.parametrize("over,nproc,msg", [
    ({"parallel.tp": "4", "launch.nnodes": "2"}, 2, "TP=4 does not divide NPROC_PER_NODE=2"),
    ({"parallel.tp": "8"}, 8, "parallel.tp=8 must divide num_attention_heads=28"),
])
def test_world_layout(atlas, over, nproc, msg):
    c = ctx(atlas, nproc=nproc, nnodes=int(over.get("launch.nnodes", 1)), **over)
    assert any(msg in r.detail for r in fails(c, "layout")), preflight.table(rows(c, "layout"))


def test_tp_beyond_the_kv_heads_is_a_valid_layout(tmp_path):
    """TP=8 with 4 KV heads: each KV head is copied on two ranks (the model supports it)."""
    assert not fails(ctx(tmp_path, cfg=dict(QWEN7B, num_attention_heads=32), nproc=8, **{"parallel.tp": "8"}),
                     "layout")


def test_layout_of_the_tiny_model_before_it_is_created(tmp_path):
    """No config.json yet: the sizes are the tiny defaults with the recipe's model.init on top."""
    for tp, nproc, bad in ((3, 3, True), (2, 2, False)):
        (tmp_path / str(tp)).mkdir()
        c = ctx(tmp_path / str(tp), npu=False, nproc=nproc, **{"parallel.tp": str(tp)})
        c.recipe.model.dir = str(tmp_path / "not-yet")
        assert c.recipe.model.init and preflight.model_config(c.recipe) is None
        got = [r.detail for r in fails(c, "layout")]
        assert (["parallel.tp=3 must divide num_attention_heads=4"] == got[:1]) if bad else not got, got


def test_vocab_parallel_needs_tp_dividing_the_vocab(tmp_path):
    odd = dict(QWEN7B, vocab_size=152065)
    bad = fails(ctx(tmp_path, cfg=odd, **{"parallel.tp": "2"}), "layout")
    assert any("vocab_size=152065" in r.detail and "vocab_parallel=false" in r.fix for r in bad), bad
    assert not fails(ctx(tmp_path, cfg=odd, **{"parallel.tp": "2", "parallel.vocab_parallel": "false"}), "layout")


def test_table_shows_fixes_and_exit_status(tmp_path):
    c = ctx(tmp_path, npu=False)
    c.recipe.data.paths = []
    out = preflight.run_checks(c)
    assert preflight.failed(out)
    assert "fix: set DATA to files or dirs, comma-separated (docker: -e DATA=" in preflight.table(out)


def test_a_crashing_check_does_not_hide_the_others(tmp_path, monkeypatch):
    def boom(c):
        raise RuntimeError("x")
    monkeypatch.setattr(preflight, "CHECKS", (boom, preflight.check_world))
    out = preflight.run_checks(ctx(tmp_path, npu=False))
    assert [r.status for r in out] == ["fail", "ok"]
    assert os.environ  # environment untouched


@pytest.mark.parametrize("rank", ["0", "1"])
def test_network_multi_node_master_at_loopback(tmp_path, rank):
    """The default 127.0.0.1 cannot be reached from the other nodes: every node fails, with the docker flags."""
    c = ctx(tmp_path, npu=False, **{"launch.nnodes": "2", "launch.node_rank": rank})
    assert "-e MASTER_ADDR=<node-0 IP> -e NODE_RANK=<0..1>" in fails(c, "network")[0].fix


def test_model_template_row_names_a_changed_chat_template(tmp_path):
    """A model dir whose own chat template writes tool results differently is named before training."""
    c = ctx(tmp_path, npu=False)
    d = Path(c.recipe.model.dir)
    c.recipe.model.init = None
    assert [r.status for r in rows(c, "template")] == ["ok"]  # no template of its own: nothing to compare
    cfg = json.loads((ASSETS_DIR / "tokenizer" / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert [r.status for r in rows(c, "template")] == ["ok"]  # Qwen2.5-Instruct's own template
    cfg["chat_template"] = cfg["chat_template"].replace("<tool_response>", "<observation>")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (r,) = rows(c, "template")
    assert r.status == "warn" and "<observation>" in r.detail and "template" in r.fix


def test_the_embedded_default_gets_a_memory_estimate_before_its_model_exists(tmp_path):
    """issue 19.9: the clean first run warned "memory estimate unavailable (no config.json yet)"."""
    recipe = load_recipe("tiny-cpu", {"output_dir": str(tmp_path / "out")}).resolved(1, "cpu")
    c = preflight.Context(recipe, devices.probe(tmp_path / "dev", tmp_path, {}, None), 1, root=tmp_path,
                          data_checker=lambda cfg: [], port_free=lambda port: True)
    (memory,) = [r for r in preflight.check_memory(c)]
    assert memory.status == "ok" and "GiB per device" in memory.detail
    assert not (tmp_path / "out" / "base-model").exists()


def test_model_template_row_of_a_qwen3_dir_with_its_released_template(tmp_path):
    """A Qwen3 model dir: the data is written in Qwen3's template, so its own template is no warning."""
    from tests.jobspec.data.data_helpers import qwen3_dir

    q3 = {**TINY, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 16}
    c = ctx(tmp_path, npu=False, cfg=q3)
    c.recipe.model.init = None
    d = qwen3_dir(Path(c.recipe.model.dir))  # Qwen3's tokenizer and tokenizer_config.json (released template)
    (d / "config.json").write_text(json.dumps(q3))
    (r,) = rows(c, "template")
    assert r.status == "ok" and "as prepare-data does" in r.detail, r.detail
