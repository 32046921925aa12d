"""Directories that appear whole or not at all: built in a temporary sibling, then renamed.

Readers (a resume, a serving container, another rank) never see half a checkpoint, cache, model
or export. The temporary directory gets the usual 0755-under-umask mode (``tempfile.mkdtemp``'s
0700 would make an export unreadable to a non-root serving container).
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def temp_sibling(final: Path) -> Path:
    """Create and return an empty ``.<name>.tmp-<pid>`` directory beside ``final``."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o755)
    return tmp


def publish(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``, replacing an earlier ``final`` (moved aside first, then removed)."""
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    try:  # make the rename durable before anyone relies on it
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


@contextmanager
def atomic_dir(final: str | os.PathLike[str]) -> Iterator[Path]:
    """``with atomic_dir(out) as tmp:`` write into ``tmp``; on success it becomes ``out``, on error it is removed."""
    final = Path(final)
    tmp = temp_sibling(final)
    try:
        yield tmp
        publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
