"""Issue 32 item 2's rule: the DP transport is chosen once (``finetune/transport.py``, called by
``init_distributed``); no other module under finetune/ asks which one it has (shared memory, native, emulated)."""
from __future__ import annotations

import ast
from pathlib import Path

from jobspec.config import REPO_ROOT

TRANSPORT = {"finetune/transport.py", "finetune/hostcomm.py"}  # the transport and its shared-memory group
# the names that tell one transport from another: the layout's choice, the implementations, their flags
TELLING = {"host_collectives", "hostcomm", "HostGroup", "Slots", "SharedMemory", "HostChannel", "Native", "Emulated",
           "TensorChannel", "native_rs", "native_ag", "dp_host", "native_collectives", "choose"}


def telling_names(path: Path) -> set[str]:
    """The names of ``TELLING`` that ``path`` uses (as a name, an attribute, or in an import)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            found |= {a.name for a in node.names} | set((node.module or "").split("."))
        elif isinstance(node, ast.Import):
            found |= {part for a in node.names for part in a.name.split(".")}
    return found & TELLING


def test_no_module_outside_the_transport_asks_which_dp_transport_it_is():
    files = sorted((REPO_ROOT / "finetune").rglob("*.py"))
    asking = {str(f.relative_to(REPO_ROOT)): sorted(telling_names(f)) for f in files}
    asking = {f: n for f, n in asking.items() if n and f not in TRANSPORT}
    assert asking == {"finetune/dist.py": ["choose"]}  # init_distributed: the one place it is chosen


def test_the_scan_sees_the_ways_a_module_could_ask(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from finetune.hostcomm import Slots\n"
                 "def f(rank, layout):\n    return rank.dp_host if layout.host_collectives else native_ag\n")
    assert telling_names(f) == {"hostcomm", "Slots", "dp_host", "host_collectives", "native_ag"}
