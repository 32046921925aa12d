"""atomic_dir: a directory appears whole (mode 0755 under umask 022) or not at all."""
import os
import stat

import pytest

from jobspec.fsutil import atomic_dir


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
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"]
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_atomic_dir_failure_leaves_old_and_no_temp(tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(RuntimeError):
        with atomic_dir(out) as tmp:
            (tmp / "half").write_text("y")
            raise RuntimeError("disk full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert (out / "keep").read_text() == "x"
