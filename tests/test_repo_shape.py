"""The repository's shape: no module of finetune/ or launcher/ over 450 lines (issue 11); every `make X` the
README and docs/ name is a Makefile rule."""
from __future__ import annotations

import re
from pathlib import Path

from jobspec.config import REPO_ROOT

MAX_LINES = 450


def over_limit(root: Path, packages: tuple[str, ...], limit: int = MAX_LINES) -> dict[str, int]:
    """{module path relative to ``root``: its line count} for each module of ``packages`` over ``limit`` lines."""
    counts = {str(f.relative_to(root)): len(f.read_text().splitlines())
              for pkg in packages for f in sorted((root / pkg).rglob("*.py"))}
    return {path: n for path, n in counts.items() if n > limit}


def test_no_module_over_the_line_limit():
    assert len(list((REPO_ROOT / "finetune").rglob("*.py"))) > 10
    big = over_limit(REPO_ROOT, ("jobspec", "finetune", "launcher"))
    assert big == {}, f"split these modules along their seams (limit {MAX_LINES} lines): {big}"


def test_the_count_names_the_long_module(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "short.py").write_text("x = 1\n" * 3)
    (tmp_path / "pkg" / "sub" / "long.py").write_text("x = 1\n" * 4)
    assert over_limit(tmp_path, ("pkg",), limit=3) == {"pkg/sub/long.py": 4}


def make_targets_named(text: str) -> set[str]:
    """Targets of ``make X`` in code (a code-block line or inline code); ``make a|b`` names both."""
    return {t for m in re.findall(r"(?:^|`)make ([a-z][\w|-]*)", text, re.M) for t in m.split("|") if t}


def test_every_make_target_the_docs_name_exists():
    rules = set(re.findall(r"^([\w-]+):", (REPO_ROOT / "Makefile").read_text(), re.M))
    docs = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    named = {t: str(f.relative_to(REPO_ROOT)) for f in docs for t in make_targets_named(f.read_text())}
    assert {"train", "test", "plan", "render", "generate"} <= named.keys()
    assert {t: f for t, f in named.items() if t not in rules} == {}


def test_make_targets_are_read_from_code_only():
    text = "run\n```\nmake train   # x\n```\n(`make plan|prepare-data`), then make the plan again"
    assert make_targets_named(text) == {"train", "plan", "prepare-data"}
