"""Issue 32 item 3's rule: the launcher finishes the recipe (jobspec/finish.py) and serialises it once into
plan.json; no module under finetune/ derives a run's paths again (``run_dir_of``, ``cache_dir_for``,
``resolved_model_dir``, ``tokenizer_of``): the workers read the plan's fields."""
from __future__ import annotations

import tokenize
from pathlib import Path

from jobspec.config import REPO_ROOT

DERIVERS = {"run_dir_of", "cache_dir_for", "resolved_model_dir", "tokenizer_of", "tokenizer_path_for"}


def derivers_used(path: Path) -> set[str]:
    """The names of ``DERIVERS`` in ``path``'s code (a call, an attribute, an import; not prose or strings)."""
    with path.open() as f:
        return {t.string for t in tokenize.generate_tokens(f.readline) if t.type == tokenize.NAME} & DERIVERS


def test_no_module_under_finetune_derives_a_run_path():
    files = sorted((REPO_ROOT / "finetune").rglob("*.py"))
    assert len(files) > 10
    used = {str(f.relative_to(REPO_ROOT)): derivers_used(f) for f in files}
    assert {f: n for f, n in used.items() if n} == {}


def test_the_scan_sees_a_call_an_attribute_and_an_import(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from jobspec.rundir import run_dir_of\nimport jobspec.data.cache as c\n"
                 "def f(r):\n    return c.cache_dir_for(r), resolved_model_dir(r)  # not tokenizer_of\n"
                 "'tokenizer_path_for in a message'\n")
    assert derivers_used(f) == {"run_dir_of", "cache_dir_for", "resolved_model_dir"}
