"""Issue 30 item 7: the training path calls nothing the installed MindSpore marks deprecated.

Every call ``ops.X(...)``, ``mint.X(...)``, ``nn.X(...)``, ``ms.X(...)`` / ``mindspore.X(...)`` (dotted paths
too, ``ms.hal.X``) in finetune/ is resolved in the installed MindSpore and its docstring's warnings are read:
a whole API deprecated or to be removed fails on any call; a parameter to be renamed, removed or made
keyword-only fails only when the call uses it that way (``ops.zeros(shape, dtype)`` positionally,
``ops.randn(..., seed=)``, ``ops.stack(x, axis=0)``). A new call of a deprecated name fails here, with the
MindSpore sentence that says so.
"""
from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WHOLE_API = re.compile(r"this (?:api|interface) (?:is|will be) deprecated|deprecated and will be removed|"
                       r"will be deprecated and removed|parameter order and semantics of this api will change", re.I)
RENAMED = re.compile(r"`{1,2}(\w+)`{1,2} will be renamed to", re.I)
REMOVED_PARAM = re.compile(r"parameter `(\w+)` will be removed|"
                           r"keyword arguments? ((?:`\w+`(?: and |, )?)+) will be removed", re.I)
FLAGGED = re.compile(r"deprecat|renamed|removed|keyword|will change", re.I)  # the docstring lines read
KEYWORD_ONLY = re.compile(r"`{1,2}(\w+)`{1,2} will become (?:keyword-only|a keyword parameter)", re.I)
# Calls that stay, each with why.
KEPT = {
    "ms.set_context": "mode=PYNATIVE_MODE in run/loop.py and generate.py: 2.10 says only 'will be deprecated in future "
                      "versions' and names no replacement for `mode` (PyNative is its default: the call can go)",
    "ops.assign_add": "the in-place gradient accumulation (parallel/overlap.py): measured on CPU, 2.10's documented "
                      "replacement Tensor.add_ returns a new tensor and leaves its own unchanged, and InplaceAddExt "
                      "has no CPU kernel; assign_add is the one in-place add that runs on both devices",
}


def _calls() -> list[tuple[str, int, str, ast.Call]]:
    """(file, line, dotted name, call) of every call rooted at a MindSpore module name in finetune/."""
    roots = {"ops", "mint", "nn", "ms", "mindspore"}
    out = []
    for path in sorted((ROOT / "finetune").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            parts, f = [], node.func
            while isinstance(f, ast.Attribute):
                parts.append(f.attr)
                f = f.value
            if isinstance(f, ast.Name) and f.id in roots and parts:
                out.append((str(path.relative_to(ROOT)), node.lineno, ".".join([f.id, *reversed(parts)]), node))
    return out


def _resolve(name: str):
    import mindspore as ms
    from mindspore import mint, nn, ops

    obj = {"ops": ops, "mint": mint, "nn": nn, "ms": ms, "mindspore": ms}[name.split(".")[0]]
    for attr in name.split(".")[1:]:
        obj = getattr(obj, attr, None)
    return obj


def _warnings(obj) -> list[str]:
    doc = inspect.getdoc(obj) or ""
    flagged = [ln.strip() for ln in doc.splitlines() if FLAGGED.search(ln)]
    return [" ".join(doc.split("\n\n")[0].split()), *flagged]


def problems_of(name: str, call: ast.Call, obj) -> list[str]:
    """What in this call the object's docstring marks deprecated (empty: nothing)."""
    out = []
    keywords = {k.arg for k in call.keywords}
    for line in _warnings(obj):
        if WHOLE_API.search(line):
            out.append(line)
        for m in RENAMED.finditer(line):
            if m.group(1) in keywords:
                out.append(f"keyword {m.group(1)}=: {line}")
        for m in REMOVED_PARAM.finditer(line):
            names = [m.group(1)] if m.group(1) else re.findall(r"`(\w+)`", m.group(2))
            out += [f"keyword {n}=: {line}" for n in names if n in keywords]
        for m in KEYWORD_ONLY.finditer(line):
            params = list(inspect.signature(obj).parameters)
            if m.group(1) in params and len(call.args) > params.index(m.group(1)):
                out.append(f"{m.group(1)} passed by position: {line}")
    return out


def test_finetune_calls_nothing_the_installed_mindspore_marks_deprecated(ms_cpu):
    found = []
    for path, line, name, call in _calls():
        obj = _resolve(name)
        if obj is None or inspect.ismodule(obj) or name in KEPT:
            continue
        found += [f"{path}:{line} {name}: {why}" for why in problems_of(name, call, obj)]
    assert not found, "\n".join(found)


DEPRECATED = ["ops.assign(p, v)", "ops.tensor_scatter_elements(p, c, u, 1)", "ms.hal.get_device_name(0, 'Ascend')",
              "ops.gather(w, ids, 0)", "ops.ones((2, 3), ms.int32)", "ops.zeros((2, 3), ms.float32)",
              "ops.randn((2, 3), seed=1)", "ms.Tensor.from_numpy(a)", "ops.stack(xs, axis=0)",
              "ops.mean(h, -1, keep_dims=True)", "ops.addcmul(v, g, g, 0.5)"]
REPLACEMENTS = ["ops.zeros((2, 3), dtype=ms.float32)", "ops.randn((2, 3))", "ops.stack(xs, 0)", "ms.from_numpy(a)",
                "mint.ones((2, 3), dtype=ms.int32)"]


@pytest.mark.parametrize("source, deprecated", [(s, True) for s in DEPRECATED] + [(s, False) for s in REPLACEMENTS])
def test_the_rules_tell_each_replaced_call_from_its_replacement(ms_cpu, source, deprecated):
    """The rules catch every call issue 30 replaced (so the scan above can fail) and pass their replacements."""
    call = ast.parse(source).body[0].value
    name = source.split("(")[0]
    assert bool(problems_of(name, call, _resolve(name))) is deprecated
