"""Hugging Face directory I/O: safetensors round trip, sharding, bf16, clear errors."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from finetune.io.hf_io import HFModelError, bf16_to_fp32, fp32_to_bf16, load_hf_config, plan_shards, weight_files
from jobspec.fsutil import MARKER
from jobspec.hf_files import read_header

GOLDEN = Path(__file__).resolve().parent / "golden"


def _model(ms_cpu, model_dir):
    from finetune.io.hf_io import load_weights
    from finetune.model.decoder import DecoderLM, ModelConfig

    model = DecoderLM(ModelConfig.from_dict(load_hf_config(model_dir)))
    load_weights(model, model_dir)
    return model


def _state(model) -> dict[str, np.ndarray]:
    return {n: p.asnumpy() for n, p in model.hf_state().items()}


def test_fp32_round_trip_is_exact(ms_cpu, tmp_path):
    from finetune.io.hf_io import export_hf

    model = _model(ms_cpu, GOLDEN / "untied")
    out = export_hf(model, GOLDEN / "untied", tmp_path / "hf", dtype="fp32", shard_size_bytes=10**9)
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "config.json", "generation_config.json",
                                                     "model.safetensors"]
    original = load_file(str(GOLDEN / "untied" / "model.safetensors"))
    assert load_file(str(out / "model.safetensors")).keys() == original.keys()
    again = _state(_model(ms_cpu, out))
    for name, value in original.items():
        np.testing.assert_array_equal(again[name], value, err_msg=name)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == "float32" and cfg["tie_word_embeddings"] is False
    assert not list(tmp_path.glob(".hf.tmp-*"))


def test_sharded_export_and_load(ms_cpu, tmp_path):
    from finetune.io.hf_io import export_hf

    model = _model(ms_cpu, GOLDEN / "tied")
    limit = 40_000
    out = export_hf(model, GOLDEN / "tied", tmp_path / "hf", dtype="fp32", shard_size_bytes=limit)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*.safetensors"))
    n = len(shards)
    assert n >= 3 and not (out / "model.safetensors").exists()
    assert [s.name for s in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    total = 0
    for shard in shards:
        tensors = load_file(str(shard))
        size = sum(t.nbytes for t in tensors.values())
        assert size <= limit or len(tensors) == 1  # a single tensor larger than the limit gets its own shard
        total += size
        for name in tensors:
            assert index["weight_map"][name] == shard.name
    assert index["metadata"]["total_size"] == total and index["metadata"]["total_parameters"] == total // 4
    assert set(index["weight_map"]) == set(model.hf_state())
    again = _state(_model(ms_cpu, out))
    for name, value in _state(model).items():
        np.testing.assert_array_equal(again[name], value, err_msg=name)


def test_bf16_export_rounds_to_nearest_even(ms_cpu, tmp_path):
    from finetune.io.hf_io import export_hf

    model = _model(ms_cpu, GOLDEN / "untied")
    out = export_hf(model, GOLDEN / "untied", tmp_path / "hf", dtype="bf16")
    header, _ = read_header(out / "model.safetensors")
    assert {m["dtype"] for m in header.values()} == {"BF16"}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = _state(_model(ms_cpu, out))
    for name, value in _state(model).items():
        np.testing.assert_allclose(loaded[name], value, rtol=2**-8, atol=1e-30, err_msg=name)
    # loading a bf16 file into fp32 and exporting bf16 again is lossless
    out2 = export_hf(_model(ms_cpu, out), out, tmp_path / "hf2", dtype="bf16")
    assert (out2 / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_bf16_conversion_exact_cases():
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-9, -2.5, np.inf, np.nan, 3.38e38, 3.4e38], np.float32)
    bits = fp32_to_bf16(x)
    # ties go to even: 1+2^-8 -> 1.0, 1+3*2^-8 -> 1+2^-6; above bf16's max + half an ulp -> inf (as torch)
    assert list(bits[:6]) == [0x3F80, 0x3F80, 0x3F82, 0x3F80, 0xC020, 0x7F80]
    assert np.isnan(bf16_to_fp32(bits[6:7]))[0]
    assert bf16_to_fp32(bits[7:8])[0] == pytest.approx(3.38e38, rel=2**-8)
    assert bits[8] == 0x7F80
    fp16 = np.float16(np.pi)  # fp16 export is a plain cast
    assert fp16 == np.float32(np.pi).astype(np.float16)


def test_plan_shards_is_greedy_in_order():
    assert plan_shards([("a", 5), ("b", 5), ("c", 3), ("d", 20), ("e", 1)], 10) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert plan_shards([("a", 5), ("b", 5)], 100) == [["a", "b"]]


def test_missing_config_and_weights_errors(tmp_path):
    with pytest.raises(HFModelError, match=r"config\.json: not found.*MODEL_DIR"):
        load_hf_config(tmp_path)
    with pytest.raises(HFModelError, match="no model.safetensors or model.safetensors.index.json"):
        weight_files(tmp_path)


def test_index_naming_missing_shard(tmp_path):
    save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 16}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                         "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(HFModelError, match=r"index\.json: names shard\(s\) model-00002-of-00002\.safetensors"):
        weight_files(tmp_path)


def test_shape_mismatch_and_missing_tensor_are_reported_together(ms_cpu, tmp_path):
    import shutil

    from finetune.io.hf_io import load_weights
    from finetune.model.decoder import DecoderLM, ModelConfig

    d = tmp_path / "bad"
    shutil.copytree(GOLDEN / "untied", d)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.weight"] = np.zeros((16, 32), np.float32)
    del tensors["lm_head.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    model = DecoderLM(ModelConfig.from_dict(load_hf_config(d)))
    with pytest.raises(HFModelError) as err:
        load_weights(model, d)
    msg = str(err.value)
    assert "model.layers.0.self_attn.q_proj.weight has shape [16, 32], config.json expects [32, 32]" in msg
    assert "lm_head.weight: missing" in msg and "model.safetensors" in msg


def test_export_copies_tokenizer_and_replaces_old_export(ms_cpu, tmp_path, tiny_hf_dir):
    from finetune.io.hf_io import export_hf

    src = tiny_hf_dir()
    model = _model(ms_cpu, src)
    out = tmp_path / "hf"
    out.mkdir()
    (out / MARKER).write_text("{}")  # an earlier export of this project
    (out / "stale.txt").write_text("old")
    old_umask = os.umask(0o077)  # even a strict umask leaves the export readable by a non-root server
    try:
        export_hf(model, src, out, dtype="fp16")
    finally:
        os.umask(old_umask)
    assert out.stat().st_mode & 0o777 == 0o755
    assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {0o644}
    names = {p.name for p in out.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"} <= names
    assert "stale.txt" not in names
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    header, _ = read_header(out / "model.safetensors")
    assert {m["dtype"] for m in header.values()} == {"F16"}
    with pytest.raises(ValueError, match="export.dtype"):
        export_hf(model, src, out, dtype="int8")


def test_reads_bf16_shards_written_by_transformers(ms_cpu):
    """golden/tied-bf16: the tied golden weights saved by transformers in bf16, two shards."""
    model = _model(ms_cpu, GOLDEN / "tied-bf16")
    fp32 = load_file(str(GOLDEN / "tied" / "model.safetensors"))
    state = _state(model)
    assert state.keys() == fp32.keys()
    for name, value in fp32.items():
        np.testing.assert_array_equal(state[name], bf16_to_fp32(fp32_to_bf16(value)), err_msg=name)


@pytest.mark.parametrize("dtype, value", [("fp32", np.inf), ("fp32", np.nan), ("bf16", 3.4e38), ("fp16", 7e4)])
def test_non_finite_weights_are_never_exported(tmp_path, tiny_hf_dir, dtype, value):
    """Issue 31: an export (full or LoRA merged, both through write_hf_dir) refuses weights that are not finite
    in the export dtype (3.4e38 rounds to inf in bf16, 7e4 overflows fp16), naming the tensor; nothing published,
    no temporary directory left. The same finite weights in fp32 are written."""
    from finetune.io.hf_io import NonFiniteWeights, write_hf_dir

    shapes = {"a.weight": (2, 3), "b.weight": (4,)}
    bad = {"a.weight": np.ones((2, 3), np.float32), "b.weight": np.array([1, value, 2, 3], np.float32)}
    base, out = tiny_hf_dir(), tmp_path / "run"
    out.mkdir()
    with pytest.raises(NonFiniteWeights, match=f"b.weight: 1 non-finite values in {dtype}"):
        write_hf_dir(out / "hf", base, shapes, bad.__getitem__, dtype)
    assert list(out.iterdir()) == []
    if np.isfinite(value):
        assert write_hf_dir(out / "hf", base, shapes, bad.__getitem__, "fp32") == out / "hf"
