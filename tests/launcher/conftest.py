"""Fixtures for launcher tests (helpers live in launcher_fakes.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
from launcher_fakes import eight_numa_nodes, make_dev, make_driver, make_sys


@pytest.fixture
def atlas(tmp_path: Path) -> Path:
    """A complete Atlas 800T A2 root: 8 NPUs, management devices, driver mounts, CANN, 8 NUMA nodes."""
    make_dev(tmp_path)
    make_driver(tmp_path)
    make_sys(tmp_path, eight_numa_nodes(), cpuset_v2="0-191")
    return tmp_path
