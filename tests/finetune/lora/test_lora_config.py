"""The lora recipe section and train.method: defaults as peft's, every bad value one problem naming the key."""
from __future__ import annotations

import pytest

from jobspec.config import ConfigError
from jobspec.lora_config import TARGETS, LoraConfig
from jobspec.recipe_load import load_recipe


def test_defaults_are_peft_s():
    c = load_recipe("tiny-cpu").lora
    assert (c.r, c.alpha, c.dropout, c.bias, c.init, c.use_rslora) == (8, 16.0, 0.05, "none", "default", False)
    assert c.target_modules == list(TARGETS) and c.scale == 2.0
    assert LoraConfig(r=16, alpha=16, use_rslora=True).scale == 4.0
    assert load_recipe("tiny-cpu").train.method == "full"


def test_every_bad_value_is_reported_at_once():
    with pytest.raises(ConfigError) as e:
        load_recipe("tiny-cpu", {"train.method": "qlora", "lora.r": "0", "lora.alpha": "0", "lora.dropout": "1",
                                 "lora.bias": "all", "lora.init": "pissa", "lora.target_modules": "q_proj,qkv",
                                 "lora.modules_to_save": "norm"})
    keys = [p.key for p in e.value.items]
    assert keys == ["train.method", "lora.r", "lora.alpha", "lora.dropout", "lora.bias", "lora.init",
                    "lora.target_modules", "lora.modules_to_save"]
    assert "qkv" in str(e.value) and "e.g. lora.r=8" in str(e.value)
    assert load_recipe("tiny-cpu-lora", {"train.compile_layers": "true"}).resolved(1, "cpu").train.compile_layers


@pytest.mark.parametrize("regex,ok", [(r".*\.(q|v)_proj", True), ("(q", False), (r".*\.qkv", False)])
def test_target_modules_takes_one_regex(regex, ok):
    if ok:
        c = load_recipe("tiny-cpu-lora", {"lora.target_modules": regex}).lora
        assert c.targets("model.layers.3.self_attn.v_proj") and not c.targets("model.layers.3.mlp.up_proj")
    else:
        with pytest.raises(ConfigError, match="lora.target_modules"):
            load_recipe("tiny-cpu-lora", {"lora.target_modules": regex})


def test_7b_lora_at_4096_fits_one_64gb_npu_by_the_estimate():
    """Qwen2.5-7B, r 8 on all seven layers: peft's 20,185,088 trainable parameters; the frozen bf16 base
    dominates, gradients and Adam state are the adapters' only."""
    from jobspec.lora_config import trainable_elements
    from jobspec.memory import estimate_memory

    qwen7b = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                  num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
    assert trainable_elements(qwen7b, LoraConfig()) == (20_185_088, 0)
    kw = dict(seq_len=4096, micro_batch_size=1, precision="bf16", recompute=True, loss_chunk_tokens=1024)
    lora, full = estimate_memory(qwen7b, lora=LoraConfig(), **kw), estimate_memory(qwen7b, **kw)
    print(lora.table())
    assert lora.total < 64e9 * 0.5 < full.total
    assert (lora.grads, lora.master, lora.optimizer) == (20_185_088 * 4, 0, 2 * 20_185_088 * 4)
    assert lora.weights == full.weights + 20_185_088 * 4  # the base in bf16 + the fp32 adapters
    saved = estimate_memory(qwen7b, lora=LoraConfig(modules_to_save=["lm_head"]), **kw)
    assert saved.master == 152064 * 3584 * 4 and saved.grads == 20_185_088 * 4 + 152064 * 3584 * 2  # bf16 head
