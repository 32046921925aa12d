"""Fixtures for the Ascend path under the contract twins."""
from __future__ import annotations

import pytest


@pytest.fixture
def twins(ms_cpu, monkeypatch):
    """The fused Ascend ops replaced by their contract twins; yields the per-op call counts."""
    from tests.finetune.contracts.twins import install

    return install(monkeypatch.setattr)
