"""A model directory's own chat template against prepare-data's Qwen2.5 format."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from jobspec.config import ASSETS_DIR
from jobspec.data.chat_template import check_model_template, model_template, render_hf

GOLDEN = json.loads((Path(__file__).parent / "golden_template.json").read_text())
SYSTEM = "You are a helpful assistant."


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_render_hf_gives_the_text_of_transformers(name):
    g = GOLDEN[name]
    assert render_hf(model_template(ASSETS_DIR / "tokenizer"), g["messages"], g["tools"]) == g["text"]


def _model(tmp_path: Path, template) -> Path:
    d = tmp_path / "m"
    d.mkdir(parents=True)
    cfg = json.loads((ASSETS_DIR / "tokenizer" / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    if template is not None:
        cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_the_bundled_qwen25_template_is_ours(tmp_path):
    assert check_model_template(ASSETS_DIR / "tokenizer", SYSTEM)[0] == "same"
    d = tmp_path / "jinja"
    d.mkdir()
    shutil.copy(ASSETS_DIR / "tokenizer" / "tokenizer_config.json", d)
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")  # wins
    assert check_model_template(d, SYSTEM)[0] == "differs"


def test_a_changed_template_is_named_with_where_it_differs(tmp_path):
    qwen = model_template(ASSETS_DIR / "tokenizer")
    changed = qwen.replace("<tool_response>", "<observation>")  # tool results written differently
    status, msg = check_model_template(_model(tmp_path, changed), SYSTEM)
    assert status == "differs" and "with tool calls" in msg
    assert "user\\n<tool_response>" in msg.split("the model's")[0] and "user\\n<observation>" in msg


def test_no_template_and_a_template_that_fails(tmp_path):
    assert check_model_template(_model(tmp_path, None), SYSTEM)[0] == "none"
    (tmp_path / "m" / "tokenizer_config.json").unlink()
    broken = _model(tmp_path / "b", "{{ raise_exception('only user/assistant roles') }}")
    status, msg = check_model_template(broken, SYSTEM)
    assert status == "unchecked" and "only user/assistant roles" in msg
