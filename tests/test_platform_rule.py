"""Issue 32 item 1's rule: what the device decides is read from one record (``jobspec/platform.py``); no other
module of the three packages compares device names ('npu'/'cpu', MindSpore's 'Ascend'/'CPU')."""
from __future__ import annotations

import ast
from pathlib import Path

from jobspec.config import REPO_ROOT
from jobspec.platform import PLATFORMS, by_target, platform_of, visible_npus

PLATFORM = "jobspec/platform.py"
NAMES = {n for p in PLATFORMS.values() for n in (p.device, p.target)}


def _names_in(node: ast.AST) -> set[str]:
    """The device names ``node`` spells: a string constant, or one inside a tuple, list or set."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {e.value for e in items if isinstance(e, ast.Constant) and e.value in NAMES}


def compared_names(path: Path) -> set[str]:
    """The device names that ``path`` compares something with (``==``, ``!=``, ``in``, ...)."""
    return {name for node in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(node, ast.Compare)
            for side in (node.left, *node.comparators) for name in _names_in(side)}


def test_no_module_outside_the_platform_compares_device_names():
    files = sorted(f for package in ("finetune", "jobspec", "launcher") for f in (REPO_ROOT / package).rglob("*.py"))
    assert len(files) > 100
    comparing = {str(f.relative_to(REPO_ROOT)): sorted(compared_names(f)) for f in files}
    assert {f: n for f, n in comparing.items() if n and f != PLATFORM} == {}


def test_the_scan_sees_the_ways_a_module_could_compare(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("a = device == 'npu'\nb = 'CPU' != target\nc = x in ('Ascend', 'gpu')\nd = y == 'npu2'\n"
                 "e = 'cpu' if z else 'npu'\n")
    assert compared_names(f) == {"npu", "CPU", "Ascend"}


def test_one_vocabulary_both_ways():
    """Each platform's recipe name and MindSpore name lead to the same record; auto follows the probe."""
    for name, p in PLATFORMS.items():
        assert p.device == name and by_target(p.target) is p and platform_of(name, has_npu=not p.accelerator) is p
    assert platform_of("auto", has_npu=True).accelerator and not platform_of("auto", has_npu=False).accelerator
    assert {p.default_precision for p in PLATFORMS.values()} == {"bf16", "fp32"}


def test_no_worker_module_outside_the_platform_probes_for_npus():
    """The worker side's probes (is there an NPU, how many may this process use) are jobspec/platform.py's; the
    launcher keeps its own host probe (launcher/devices.py), mapped into the same record."""
    files = sorted(f for package in ("finetune", "jobspec") for f in (REPO_ROOT / package).rglob("*.py"))
    probing = [str(f.relative_to(REPO_ROOT)) for f in files if '"davinci' in f.read_text()
               or "'davinci" in f.read_text() or "/dev/davinci[" in f.read_text()]
    assert probing == [PLATFORM]


def test_visible_npus_counts_what_the_runtime_numbers(tmp_path):
    for name in ("davinci4", "davinci5", "davinci_manager", "davinci7"):
        (tmp_path / name).touch()
    assert visible_npus(tmp_path, {}) == 3
    assert visible_npus(tmp_path, {"ASCEND_RT_VISIBLE_DEVICES": "4,5"}) == 2
    assert visible_npus(tmp_path / "none", {}) == 0
