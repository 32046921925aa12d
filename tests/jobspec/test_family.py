"""Issue 32 item 5: one Family record per model family, which the template choice and generation read
(the model's reading of q/k/v bias, q/k norm and RoPE kind is held by the goldens of tests/finetune)."""
from __future__ import annotations

import dataclasses
import json

import pytest
from tokenizers import Tokenizer

from jobspec import family
from jobspec.config import REPO_ROOT
from jobspec.data.template import chat_format
from jobspec.family import DEFAULT, FAMILIES, family_in, family_of

TOKENIZER = REPO_ROOT / "assets" / "tokenizer" / "tokenizer.json"  # the bundled Qwen2.5 tokenizer


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_each_family_is_told_from_config_json_and_chooses_its_template(tmp_path, model_type):
    fam = FAMILIES[model_type]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": [fam.architecture]}))
    assert family_in(tmp_path) is fam and chat_format(tmp_path / "tokenizer.json") == fam.template
    assert family_of({"architectures": [fam.architecture]}) is fam  # no model_type: the architecture says it
    tok = Tokenizer.from_file(str(TOKENIZER))
    assert all(tok.token_to_id(t) is not None for t in (*fam.stop_tokens, fam.pad_token))


def test_a_directory_without_config_json_is_the_default_family(tmp_path):
    assert family_in(tmp_path) is DEFAULT and chat_format(TOKENIZER) == DEFAULT.template


def test_generation_stops_and_pads_with_the_record_s_tokens(tmp_path, monkeypatch):
    """generate reads the stop and pad tokens from the record, not from literals of its own."""
    from finetune import generate

    tok = Tokenizer.from_file(str(TOKENIZER))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert generate.stop_ids(tok, tmp_path) == {tok.token_to_id(t) for t in FAMILIES["qwen2"].stop_tokens}
    other = dataclasses.replace(FAMILIES["qwen2"], stop_tokens=("<|im_start|>",))
    monkeypatch.setitem(family.FAMILIES, "qwen2", other)
    assert generate.stop_ids(tok, tmp_path) == {tok.token_to_id("<|im_start|>")}


def test_a_rope_kind_other_than_the_family_s_is_refused():
    from finetune.model.decoder import ModelConfig

    base = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "model_type": "qwen2"}
    assert ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": FAMILIES["qwen2"].rope}}).model_type == "qwen2"
    with pytest.raises(ValueError, match="rope type 'llama3' is not supported"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "llama3"}})
