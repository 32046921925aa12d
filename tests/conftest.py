"""Shared fixtures. Nothing here imports mindspore at collection time (launcher tests check that)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

# A small Qwen2 config for fast tests: tiny vocab, GQA 4 heads / 2 KV heads, 2 layers.
SMALL_MODEL = {"vocab_size": 512, "hidden_size": 32, "intermediate_size": 88, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="session")
def ms_cpu():
    """MindSpore in PyNative mode on CPU as the workers set it (imported only by tests that ask for it)."""
    import mindspore as ms

    from finetune.dist import set_device

    ms.set_context(mode=ms.PYNATIVE_MODE)
    set_device("CPU", None)
    return ms


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory, request) -> Path:
    """A directory for one module's shared fixtures, removed after the module unless a test failed.

    The disk counterpart of tmp_path_retention_policy = "failed" (pyproject.toml), which pytest
    applies only to function-scoped tmp_path: kept for the whole session, the msrun modules' runs
    added up to 6 GB by the time tests/test_image.py builds the image (a CI machine ran out there).
    """
    path = tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])
    failed_before = request.session.testsfailed
    yield path
    if request.session.testsfailed == failed_before:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def tiny_hf_dir(tmp_path):
    """Factory: a seeded random-init HF Qwen2 dir (small by default) -> its path."""
    from jobspec.tiny import ensure_tiny_model

    def make(name: str = "model", seed: int = 0, **overrides) -> Path:
        path = tmp_path / name
        ensure_tiny_model(path, {**SMALL_MODEL, **overrides}, seed)
        return path

    return make
