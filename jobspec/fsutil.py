"""Directories that appear whole or not at all: built in a temporary sibling, then renamed.

Readers (a resume, a serving container, another rank) never see half a checkpoint, cache, model
or export. One mode rule for all of them, whatever the umask: directories 0755, files 0644
(``tempfile.mkdtemp``'s 0700 or a library's 0600 would lock out a non-root serving container).

Replacement rule (every publish in the project): a directory already standing at the target is
replaced only when this project wrote it (it holds :data:`MARKER`) or it is empty; anything else
is refused with :class:`ForeignDirectory`, naming the path and the fix. So ``export --out`` can
never delete a run directory or a directory of the user's own files.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

MARKER = ".ascend-finetune.json"  # written into every directory atomic_dir publishes
# .<name>.tmp-<host>-<pid> (older: .<name>.tmp-<pid>): the host, so that a node sharing the storage never takes
# another node's live process for a dead one of its own
_TEMP = re.compile(r"^\..+\.(?:tmp|old)-(?:(?P<host>[A-Za-z0-9_-]+)-)?(?P<pid>\d+)$")


def file_hash(path: Path) -> str:
    """The sha256 hex digest of a file's content (the project's one checksum: checkpoints, model identity, the
    token cache's sources and tokenizer)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _me() -> str:
    """This process's tag in temporary names: ``<host>-<pid>`` (the host name's other characters as ``_``)."""
    return f"{re.sub(r'[^A-Za-z0-9_-]', '_', socket.gethostname())}-{os.getpid()}"


class ForeignDirectory(ValueError):
    """The target directory exists and was not written by this project: it is never replaced."""


def temp_sibling(final: Path) -> Path:
    """Create and return an empty ``.<name>.tmp-<host>-<pid>`` directory beside ``final``."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{_me()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o755)
    return tmp


def check_replaceable(final: Path) -> None:
    """Raise :class:`ForeignDirectory` unless ``final`` is absent, empty, or written by this project."""
    if not final.exists() and not final.is_symlink():
        return
    if final.is_dir() and not final.is_symlink() and ((final / MARKER).is_file() or not any(final.iterdir())):
        return
    raise ForeignDirectory(
        f"{final} exists and was not written by ascend-finetune (no {MARKER} in it): it is never replaced. "
        f"Choose a new or empty directory, or move {final} away yourself")


def publish(tmp: Path, final: Path, owned: bool = False) -> None:
    """Rename ``tmp`` to ``final`` (its directories made 0755, its files 0644), replacing an earlier ``final`` of
    this project (moved aside first, then removed); ``owned``: the caller knows ``final`` is its own by its place
    (a checkpoint's step directory)."""
    if not owned:
        check_replaceable(final)
    for p in [tmp, *tmp.rglob("*")]:  # one rule for everything published: readable by a non-root reader
        p.chmod(0o755 if p.is_dir() else 0o644)
    old = final.parent / f".{final.name}.old-{_me()}"
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
def atomic_dir(final: Path | str, kind: str = "output") -> Iterator[Path]:
    """``with atomic_dir(out) as tmp:`` write into ``tmp``; on success it becomes ``out``, on error it is removed.

    Refused before anything is written when ``out`` exists and is not this project's (:func:`check_replaceable`);
    ``kind`` goes into the marker file (e.g. "hf-export", "token-cache").
    """
    final = Path(final)
    check_replaceable(final)
    tmp = temp_sibling(final)
    try:
        (tmp / MARKER).write_text(json.dumps({"written_by": "ascend-finetune", "kind": kind}) + "\n")
        yield tmp
        publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(*parents: Path | str, log: Callable[[str], None] = print) -> list[Path]:
    """Remove the ``.<name>.tmp-<host>-<pid>`` / ``.<name>.old-<host>-<pid>`` directories of this host's dead
    processes under ``parents`` (left by a kill during an export, save or prepare), saying so; the removed paths.
    Another host's are left to that host: safe when nodes share the storage, each node cleans its own."""
    removed = []
    me = _me().rsplit("-", 1)[0]
    for parent in map(Path, parents):
        for p in sorted(parent.glob(".*")) if parent.is_dir() else []:
            m = _TEMP.match(p.name)
            if not m or m["host"] not in (None, me) or not p.is_dir() or p.is_symlink():
                continue
            pid = int(m["pid"])
            if pid == os.getpid() or pid_alive(pid):
                continue
            shutil.rmtree(p, ignore_errors=True)
            if not p.exists():  # another process of this node may have removed it first
                removed.append(p)
                log(f"[cleanup] removed {p}: a temporary directory of process {pid}, which is gone "
                    "(killed during a write)")
    return removed
