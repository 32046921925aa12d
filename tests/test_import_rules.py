"""The three packages' import rules, for every module at any depth in the file (jobspec/__init__.py says why):

- jobspec imports nothing of ours but itself, and no MindSpore: the launcher and every rank read it;
- launcher imports jobspec, never finetune (the worker side: it starts it as processes) nor MindSpore;
- finetune imports jobspec and itself, never launcher.
"""
from __future__ import annotations

import ast
import subprocess
import sys

from jobspec.config import REPO_ROOT

RULES = {"jobspec": {"finetune", "launcher", "mindspore"}, "launcher": {"finetune", "mindspore"},
         "finetune": {"launcher"}}


def _imports(path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}  # a name may be a module
    return names


def forbidden_imports(package: str) -> dict[str, list[str]]:
    """{module path: the imports of it that ``RULES`` forbids} for every module of ``package``."""
    files = sorted((REPO_ROOT / package).rglob("*.py"))
    assert len(files) > 10, package
    bad = {str(f.relative_to(REPO_ROOT)): sorted(n for n in _imports(f) if n.split(".")[0] in RULES[package])
           for f in files}
    return {f: n for f, n in bad.items() if n}


def test_each_package_imports_only_what_its_layer_may():
    assert {p: forbidden_imports(p) for p in RULES} == {p: {} for p in RULES}


def test_every_jobspec_module_imports_without_mindspore():
    """At run time too: a module of jobspec that pulled in MindSpore through a third package fails here."""
    mods = sorted(".".join(f.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__")
                  for f in (REPO_ROOT / "jobspec").rglob("*.py"))
    code = (f"import importlib, sys\nfor m in {mods!r}: importlib.import_module(m)\n"
            "sys.exit(sorted({m.split('.')[0] for m in sys.modules} & {'mindspore', 'finetune', 'launcher'}) or 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_the_scan_sees_imports_anywhere_in_a_module(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from launcher.numa import plan\n    import launcher\n")
    assert _imports(f) == {"launcher.numa", "launcher.numa.plan", "launcher"}


def _graph(package: str) -> dict[str, set[str]]:
    """{module: the modules of ``package`` it imports (at any depth in the file)}."""
    root = REPO_ROOT / package.replace(".", "/")
    mods = {".".join(f.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__"): f
            for f in root.rglob("*.py")}
    graph = {}
    for m, f in mods.items():
        deps = set()
        for name in _imports(f):
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != m:
                deps.add(name)
        graph[m] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of the graph, or []."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (c := visit(d)):
                return c
        stack.pop()
        state[m] = 2
        return []

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return []


def test_no_import_circles_in_the_data_package():
    graph = _graph("jobspec.data")
    assert "jobspec.data.cache" in graph["jobspec.data.prepare"]
    assert _cycle(graph) == []
    assert _cycle({**graph, "jobspec.data.cache": {"jobspec.data.prepare"}})  # the circle there was


def test_no_import_circles_in_any_package():
    for package in ("jobspec", "finetune", "launcher"):
        graph = _graph(package)
        assert len(graph) > 10 and _cycle(graph) == [], package
    graph = _graph("jobspec")
    assert "jobspec.recipe_parse" in graph["jobspec.config"]
    circle = _cycle({**graph, "jobspec.recipe_parse": {"jobspec.config"}})
    assert circle in (["jobspec.config", "jobspec.recipe_parse", "jobspec.config"],
                      ["jobspec.recipe_parse", "jobspec.config", "jobspec.recipe_parse"])
