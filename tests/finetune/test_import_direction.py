"""Imports flow one way: launcher -> finetune, never back (every module of finetune/ scanned)."""
from __future__ import annotations

import ast

from finetune.config import REPO_ROOT


def _imports(path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}  # a name may be a module
    return names


def test_finetune_never_imports_launcher():
    files = sorted((REPO_ROOT / "finetune").rglob("*.py"))
    assert len(files) > 10
    bad = {str(f.relative_to(REPO_ROOT)): sorted(n for n in _imports(f) if n.split(".")[0] == "launcher")
           for f in files}
    assert {f: n for f, n in bad.items() if n} == {}


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
    graph = _graph("finetune.data")
    assert "finetune.data.cache" in graph["finetune.data.prepare"]
    assert _cycle(graph) == []
    assert _cycle({**graph, "finetune.data.cache": {"finetune.data.prepare"}})  # the circle there was


def test_no_import_circles_in_finetune_or_launcher():
    for package in ("finetune", "launcher"):
        graph = _graph(package)
        assert len(graph) > 10 and _cycle(graph) == [], package
    graph = _graph("finetune")
    assert "finetune.recipe_parse" in graph["finetune.config"]
    circle = _cycle({**graph, "finetune.recipe_parse": {"finetune.config"}})
    assert circle[0] == circle[-1] and {"finetune.config", "finetune.recipe_parse"} <= set(circle)  # the
    # edge added closes a circle through both (config -> lora_config -> recipe_parse -> config, or directly)


def test_the_data_package_and_cpus_import_no_mindspore():
    """The launcher runs prepare-data and the CPU count on the host, which has no mindspore to spare."""
    files = sorted((REPO_ROOT / "finetune" / "data").rglob("*.py")) + [REPO_ROOT / "finetune" / "cpus.py"]
    assert {str(f.relative_to(REPO_ROOT)) for f in files if any(n.split(".")[0] == "mindspore" for n in _imports(f))} \
        == set()
