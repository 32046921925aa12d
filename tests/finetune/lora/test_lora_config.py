"""The lora recipe section and train.method: defaults as peft's, every bad value one problem naming the key."""
from __future__ import annotations

import pytest

from finetune.config import ConfigError, load_recipe
from finetune.lora_config import TARGETS, LoraConfig


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


@pytest.mark.parametrize("regex,ok", [(r".*\.(q|v)_proj", True), ("(q", False), (r".*\.qkv", False)])
def test_target_modules_takes_one_regex(regex, ok):
    if ok:
        c = load_recipe("tiny-cpu", {"lora.target_modules": regex}).lora
        assert c.targets("model.layers.3.self_attn.v_proj") and not c.targets("model.layers.3.mlp.up_proj")
    else:
        with pytest.raises(ConfigError, match="lora.target_modules"):
            load_recipe("tiny-cpu", {"lora.target_modules": regex})
