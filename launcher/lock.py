"""One training job per OUTPUT_DIR: an exclusive lock naming its holder (pid, host, start time).

``fcntl.flock`` on ``<output_dir>/.lock`` (``.lock.node<N>`` for node N > 0 of a multi-node job,
whose nodes share the directory). The kernel releases the lock when the holder and every process
that inherited its descriptor (msrun) are gone, so a lock file naming a dead holder is taken over.
``plan`` only checks the lock (:func:`checked`) and creates no lock file.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from jobspec.rundir import RunDir


class Locked(Exception):
    """Another live job holds the output directory."""


def lock_path(output_dir: Path, node_rank: int = 0, nnodes: int = 1) -> Path:
    return RunDir(output_dir).lock(0 if nnodes == 1 else node_rank)


def _describe(holder: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} (since {since})"


def acquire(output_dir: Path, node_rank: int = 0, nnodes: int = 1,
            log: Callable[[str], None] = print) -> int:
    """Take the lock; return its file descriptor (keep it open for the job's lifetime).

    Raises :class:`Locked` naming the holder and the fix when another job holds it.
    """
    path = lock_path(output_dir, node_rank, nnodes)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _lock(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), path, output_dir)
    previous = _read(fd)
    if previous.get("pid"):
        log(f"taking over the lock {path} of a job that is gone: {_describe(previous)}")
    me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
    os.fsync(fd)
    return fd


@contextmanager
def checked(output_dir: Path, node_rank: int = 0, nnodes: int = 1) -> Iterator[None]:
    """Hold the lock while the body runs if its file exists; without one (no job ever ran here) create none.

    Raises :class:`Locked` as :func:`acquire` does. A job that starts in the instant between the check for
    the file and the end of the body is not seen.
    """
    path = lock_path(output_dir, node_rank, nnodes)
    try:
        fd: int | None = _lock(os.open(path, os.O_RDWR), path, output_dir)
    except FileNotFoundError:
        fd = None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _lock(fd: int, path: Path, output_dir: Path) -> int:
    """``fd`` locked, or closed and :class:`Locked` raised naming the holder and the fix."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read(fd)
        os.close(fd)
        raise Locked(f"OUTPUT_DIR {output_dir} is in use by another training job: {_describe(holder)} "
                     f"(lock file {path}). Wait for it to finish or stop it, or use another OUTPUT_DIR") from None
    return fd


def release(fd: int) -> None:
    """Empty the lock file (no holder) and drop the lock."""
    try:
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)


def _read(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
