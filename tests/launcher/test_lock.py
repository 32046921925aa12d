"""One job per OUTPUT_DIR: a second run is refused naming the holder; a dead holder's lock is taken over."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from launcher import lock


def _snapshot(d):
    return sorted((str(p.relative_to(d)), p.stat().st_size, p.stat().st_mtime_ns) for p in d.rglob("*"))


def test_second_run_is_refused_naming_the_holder_and_changes_nothing(tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from launcher.lock import acquire; acquire(Path(sys.argv[1])); "
                               "print('held', flush=True); time.sleep(60)", str(out)],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert holder.stdout.readline().strip() == "held"
        (out / "metrics.jsonl").write_text('{"step": 1}\n')
        before = _snapshot(out)
        env = {**os.environ, "OUTPUT_DIR": str(out), "PYTHONPATH": os.getcwd()}
        r = subprocess.run([sys.executable, "-m", "launcher", "train"], env=env, capture_output=True, text=True,
                           timeout=120, cwd=tmp_path)
        assert r.returncode == 1, r.stdout + r.stderr
        assert f"in use by another training job: pid {holder.pid} on host {socket.gethostname()}" in r.stderr
        assert "use another OUTPUT_DIR" in r.stderr and "Traceback" not in r.stderr
        assert _snapshot(out) == before  # no model, no data cache, no plan: nothing started
    finally:
        holder.kill()
        holder.wait()


def test_a_dead_holders_lock_is_taken_over_with_a_log_line(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / ".lock").write_text(json.dumps({"pid": dead.pid, "host": "node-a", "since": time.time() - 60}))
    lines: list[str] = []
    fd = lock.acquire(tmp_path, log=lines.append)
    try:
        assert len(lines) == 1 and f"a job that is gone: pid {dead.pid} on host node-a" in lines[0]
        mine = json.loads((tmp_path / ".lock").read_text())
        assert mine["pid"] == os.getpid() and mine["host"] == socket.gethostname()
        with pytest.raises(lock.Locked, match=f"pid {os.getpid()}"):
            lock.release(lock.acquire(tmp_path))  # the same process, a second descriptor: refused too
    finally:
        lock.release(fd)
    assert (tmp_path / ".lock").read_text() == ""
    lock.release(lock.acquire(tmp_path, log=lines.append))
    assert len(lines) == 1  # a cleanly released lock names no holder: no take-over line


def test_nodes_of_one_job_lock_separately(tmp_path):
    """Two nodes sharing OUTPUT_DIR each hold their own lock; a second process for node 1 is refused."""
    a = lock.acquire(tmp_path, node_rank=0, nnodes=2)
    b = lock.acquire(tmp_path, node_rank=1, nnodes=2)
    try:
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
        assert json.loads((tmp_path / ".lock.node1").read_text())["pid"] == os.getpid()
        with pytest.raises(lock.Locked):
            lock.acquire(tmp_path, node_rank=1, nnodes=2)
    finally:
        lock.release(a)
        lock.release(b)


def test_checking_creates_no_lock_file_and_holds_an_existing_one(tmp_path):
    with lock.checked(tmp_path, node_rank=1, nnodes=2):
        (tmp_path / "plan.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]

    lock.release(lock.acquire(tmp_path))  # a finished job's lock file: empty, free
    with lock.checked(tmp_path):
        with pytest.raises(lock.Locked):  # held while the body runs
            lock.acquire(tmp_path)
    lock.release(lock.acquire(tmp_path))  # and free again afterwards


def test_checking_a_held_lock_is_refused_naming_the_holder(tmp_path):
    fd = lock.acquire(tmp_path)
    try:
        with pytest.raises(lock.Locked, match=f"pid {os.getpid()}"):
            with lock.checked(tmp_path):
                pytest.fail("the body must not run under another job's lock")
    finally:
        lock.release(fd)
