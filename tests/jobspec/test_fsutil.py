"""atomic_dir: a directory appears whole (mode 0755 under umask 022) or not at all, and replaces only
its own; stale temporary directories of dead processes are cleaned up."""
import json
import os
import stat
import subprocess
import sys

import pytest

from jobspec.fsutil import MARKER, ForeignDirectory, atomic_dir, remove_stale_temps


def test_atomic_dir_publishes_readable_and_replaces(tmp_path):
    out = tmp_path / "hf"
    old_umask = os.umask(0o022)
    try:
        with atomic_dir(out) as tmp:
            (tmp / "a.txt").write_text("1")
            assert not out.exists()
        with atomic_dir(out) as tmp:
            (tmp / "b.txt").write_text("2")
    finally:
        os.umask(old_umask)
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "b.txt"]
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_atomic_dir_failure_leaves_old_and_no_temp(tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / MARKER).write_text("{}")
    (out / "keep").write_text("x")
    with pytest.raises(RuntimeError):
        with atomic_dir(out) as tmp:
            (tmp / "half").write_text("y")
            raise RuntimeError("disk full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert (out / "keep").read_text() == "x"


def test_atomic_dir_refuses_a_directory_it_did_not_write(tmp_path):
    """issue 19.1: a directory of the user's own files (or a run directory) is never replaced."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("precious")
    with pytest.raises(ForeignDirectory, match=f"{out}.*not written by ascend-finetune.*new or empty directory"):
        with atomic_dir(out):
            raise AssertionError("the body must not run")
    assert (out / "notes.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_atomic_dir_replaces_its_own_and_empty_directories(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with atomic_dir(empty, "hf-export") as tmp:
        (tmp / "a").write_text("1")
    assert json.loads((empty / MARKER).read_text())["kind"] == "hf-export"
    with atomic_dir(empty) as tmp:  # its own marker: replaced
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in empty.iterdir()) == [MARKER, "b"]


def test_stale_temps_of_dead_processes_are_removed_and_named(tmp_path):
    """issue 19.13: a kill during an export leaves .hf.tmp-<pid>; the next start removes it, saying so."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale, live = tmp_path / f".hf.tmp-{dead.pid}", tmp_path / f".hf.tmp-{os.getppid()}"
    for d in (stale, live, tmp_path / "hf"):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x" * 10)
    said = []
    assert remove_stale_temps(tmp_path, log=said.append) == [stale]
    assert not stale.exists() and live.exists() and (tmp_path / "hf").exists()
    assert str(stale) in said[0] and str(dead.pid) in said[0]


def test_everything_published_is_0755_and_0644_whatever_the_umask(tmp_path):
    """issue 19 (smaller): checkpoints and the created base model were 0600 while exports were 0644."""
    old_umask = os.umask(0o077)
    try:
        with atomic_dir(tmp_path / "out") as tmp:
            (tmp / "sub").mkdir()
            (tmp / "sub" / "w.safetensors").write_bytes(b"x")
            os.chmod(tmp / "sub" / "w.safetensors", 0o600)
    finally:
        os.umask(old_umask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [tmp_path / "out", *(tmp_path / "out").rglob("*")]}
    assert modes == {"out": 0o755, "sub": 0o755, "w.safetensors": 0o644, MARKER: 0o644}


def test_a_node_removes_only_its_own_hosts_stale_temps(tmp_path):
    """issue 19.13 on shared storage: another node's process ids mean nothing here; its temps are left to it."""
    from jobspec.fsutil import _me, temp_sibling

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = _me().rsplit("-", 1)[0]
    mine, other = tmp_path / f".hf.tmp-{host}-{dead.pid}", tmp_path / f".hf.tmp-other-node-7-{dead.pid}"
    for d in (mine, other):
        d.mkdir()
    assert temp_sibling(tmp_path / "x").name == f".x.tmp-{host}-{os.getpid()}"
    said = []
    assert remove_stale_temps(tmp_path, log=said.append) == [mine]
    assert other.exists() and (tmp_path / ".x.tmp-" f"{host}-{os.getpid()}").exists()  # live: this process's
