"""The adapter in peft's format: names and config as peft writes them, read back with equal logits, and the
merged model equal to base + adapter; both give peft's logits (golden from tools/make_lora_golden.py;
``tools/make_lora_golden.py --check DIR`` loads such a directory with PeftModel.from_pretrained)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file
from test_lora_golden import BASE, G, golden_init, lora_model

from jobspec.rundir import RunDir


def _model(path):
    from finetune.io.hf_io import load_hf_config, load_weights
    from finetune.model.decoder import DecoderLM, ModelConfig

    model = DecoderLM(ModelConfig.from_dict(load_hf_config(path)))
    load_weights(model, path)
    return model


def test_adapter_and_merged_export_give_peft_s_logits(ms_cpu, tmp_path):
    from finetune.dist import RankInfo
    from finetune.io.lora_io import check_adapter_base, export_lora, load_adapter
    from jobspec.checkpoint_index import model_hash
    from jobspec.lora_config import LoraConfig

    ms = ms_cpu
    g = np.load(G)
    ids = ms.Tensor(np.load(BASE / "golden.npz")["input_ids"].astype(np.int32))
    model, params = lora_model(ms)
    golden_init(ms, params)
    ours = model.logits(ids).asnumpy()
    np.testing.assert_allclose(ours, g["logits"], atol=1e-5, rtol=0)  # peft's forward with these adapters
    export_lora(model, params, LoraConfig(r=4, alpha=8, dropout=0.0), BASE, model_hash(BASE), RunDir(tmp_path), "fp32",
                10**9, True, RankInfo())
    np.save(tmp_path / "adapter" / "logits.npy", ours)  # for tools/make_lora_golden.py --check
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["task_type"], cfg["r"], cfg["lora_alpha"], cfg["bias"]) == \
        ("LORA", "CAUSAL_LM", 4, 8.0, "none")
    assert sorted(cfg["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"])
    assert cfg["base_model_name_or_path"] == str(BASE)
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert sorted(saved) == sorted("base_model.model." + k[5:] for k in g.files if k.startswith("init/"))
    fresh = _model(BASE)
    load_adapter(fresh, tmp_path / "adapter")
    np.testing.assert_allclose(fresh.logits(ids).asnumpy(), ours, atol=1e-6, rtol=0)
    check_adapter_base(tmp_path / "adapter", BASE)  # the adapter records its base (issue 31)
    with pytest.raises(ValueError, match=f"trained on the base model {BASE} .*--model-dir {BASE}"):
        check_adapter_base(tmp_path / "adapter", tmp_path / "hf")  # the merged model is another base
    merged = _model(tmp_path / "hf")
    assert not [p.name for p in merged.get_parameters() if ".lora_" in p.name]
    np.testing.assert_allclose(merged.logits(ids).asnumpy(), ours, atol=1e-5, rtol=0)
