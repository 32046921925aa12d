"""issue 22 §2: every path of a run directory is spelled once, in jobspec/rundir.py (``RunDir``).

Reads the source of jobspec/, launcher/ and finetune/ (as tests/test_import_rules.py does) and fails on a
module that builds a run path itself: ``out / "hf"``, ``Path(out, "logs")``, a ``"metrics.jsonl"`` or
``"step_*"`` of its own. Prose (docstrings, help texts, messages) may name the files.
"""
from __future__ import annotations

import ast
import re

from jobspec.config import REPO_ROOT
from jobspec.rundir import ENTRIES

NAMES = {rel.split("/")[0] for _, rel, _ in ENTRIES}  # hf, logs, metrics.jsonl, .lock, ...
# a checkpoint's name (``step_{n:08d}``, ``step_*``; not prose like "step_N"), a node's lock and NPU log
PATTERN = re.compile(r"step_($|[{*\d])|\.lock|npu-node")
OWNER = "jobspec/rundir.py"


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            out.add(id(body[0].value))
    return out


def _is_name(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.strip("/") in NAMES


def run_path_spellings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every place ``source`` spells a run path: a run directory name joined onto a path
    (``/``, ``Path(...)``, ``joinpath``, ``glob``), a run file's name, or a name with a run path's prefix."""
    tree = ast.parse(source)
    prose = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            found += [(node.lineno, side.value) for side in (node.left, node.right) if _is_name(side)]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "Path", "joinpath", "glob", "rglob", "join"):
            found += [(node.lineno, a.value) for a in node.args if _is_name(a)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            if ("." in node.value and node.value.strip("/") in NAMES) or PATTERN.match(node.value):
                found.append((node.lineno, node.value))
    return sorted(set(found))


def test_no_module_but_rundir_spells_a_run_path():
    bad = {}
    for pkg in ("jobspec", "launcher", "finetune"):
        for path in sorted((REPO_ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(REPO_ROOT).as_posix()
            if rel != OWNER and (hits := run_path_spellings(path.read_text())):
                bad[rel] = hits
    assert not bad, f"spell these through jobspec.rundir.RunDir: {bad}"


def test_the_check_finds_each_kind_of_spelling():
    """The scanner itself: it must fail on each way a module could spell a run path."""
    src = '''
"""A docstring may say out/hf and metrics.jsonl."""
a = out / "hf"
b = Path(out, "logs")
c = out.joinpath("checkpoints")
d = root.glob("step_*")
e = f"step_{n:08d}"
f = "metrics.jsonl"
g = f".lock.node{n}"
h = log("see plan.json")
i = {"data": 1}
'''
    assert [text for _, text in run_path_spellings(src)] == [
        "hf", "logs", "checkpoints", "step_*", "step_", "metrics.jsonl", ".lock.node"]


def test_rundir_itself_is_caught_without_the_exemption():
    assert run_path_spellings((REPO_ROOT / OWNER).read_text())
