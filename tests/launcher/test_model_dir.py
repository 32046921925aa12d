"""MODEL_DIR with the CPU default recipe: a sharded model trains; the tiny model only where none was given."""
from __future__ import annotations

import json
import os

import pytest
from launcher_fakes import make_sys
from safetensors.numpy import load_file, save_file

import launcher.__main__ as lm
from jobspec.config import creates_tiny_model
from jobspec.recipe_load import load_recipe
from jobspec.tiny import ensure_tiny_model


def _sharded(tmp_path):
    """The tiny model re-saved as Hugging Face shards: model.safetensors.index.json + model-0000N-of-00002."""
    d = tmp_path / "sharded"
    ensure_tiny_model(d, {"num_hidden_layers": 2})
    weights = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(weights)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:]), 1):
        shard = f"model-0000{i}-of-00002.safetensors"
        save_file({n: weights[n] for n in part}, str(d / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def test_the_tiny_model_is_created_only_where_no_model_dir_was_given(tmp_path):
    assert creates_tiny_model(load_recipe("tiny-cpu"))
    given = load_recipe("tiny-cpu", {"model.dir": str(tmp_path / "typo")})
    assert not creates_tiny_model(given)
    lm.ensure_model(given)  # today: a random model appeared in the typo'd directory
    assert not (tmp_path / "typo").exists()
    sharded = load_recipe("tiny-cpu", {"model.dir": str(_sharded(tmp_path))})
    before = sorted(p.name for p in (tmp_path / "sharded").iterdir())
    lm.ensure_model(sharded)  # today: FileExistsError (no model.safetensors there)
    assert sorted(p.name for p in (tmp_path / "sharded").iterdir()) == before


@pytest.mark.slow
def test_a_sharded_model_trains_with_the_cpu_default_recipe(tmp_path, capsys):
    model = _sharded(tmp_path)
    (tmp_path / "dev").mkdir()
    host = lm.Host(env={"MODEL_DIR": str(model), "OUTPUT_DIR": str(tmp_path / "out"), "PATH": os.environ["PATH"],
                        "NUMA_BIND": "off"},
                   dev_dir=tmp_path / "dev", root=tmp_path, npu_smi=None,
                   sys_root=make_sys(tmp_path, {0: "0-1"}, cpuset_v2="0-1"))
    rc = lm.main(["train", "train.max_steps=2", "data.max_samples=16", "data.seq_len=64", "train.save_every=0",
                  "export.dtype=fp32"], host)
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert not (tmp_path / "out" / "base-model").exists()
    records = [json.loads(x) for x in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert json.loads((tmp_path / "out/hf/config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
