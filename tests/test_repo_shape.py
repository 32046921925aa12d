"""The house stays in rooms of a readable size: no module of finetune/ or launcher/ over 450 lines (issue 11)."""
from __future__ import annotations

from pathlib import Path

from finetune.config import REPO_ROOT

MAX_LINES = 450


def over_limit(root: Path, packages: tuple[str, ...], limit: int = MAX_LINES) -> dict[str, int]:
    """{module path relative to ``root``: its line count} for each module of ``packages`` over ``limit`` lines."""
    counts = {str(f.relative_to(root)): len(f.read_text().splitlines())
              for pkg in packages for f in sorted((root / pkg).rglob("*.py"))}
    return {path: n for path, n in counts.items() if n > limit}


def test_no_module_over_the_line_limit():
    assert len(list((REPO_ROOT / "finetune").rglob("*.py"))) > 10
    big = over_limit(REPO_ROOT, ("finetune", "launcher"))
    assert big == {}, f"split these modules along their seams (limit {MAX_LINES} lines): {big}"


def test_the_count_names_the_long_module(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "short.py").write_text("x = 1\n" * 3)
    (tmp_path / "pkg" / "sub" / "long.py").write_text("x = 1\n" * 4)
    assert over_limit(tmp_path, ("pkg",), limit=3) == {"pkg/sub/long.py": 4}
