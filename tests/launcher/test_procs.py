"""Why a worker died (signal name, OOM killer from cgroup memory events / kernel log) and killing a job's tree."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from launcher import launch, procs


def _cgroup_v2(tmp_path, oom_kills: int):
    (tmp_path / "proc/self").mkdir(parents=True, exist_ok=True)
    (tmp_path / "proc/self/cgroup").write_text("0::/kubepods/pod1/c1\n")
    d = tmp_path / "sys/fs/cgroup/kubepods/pod1/c1"
    d.mkdir(parents=True, exist_ok=True)
    # the format of a real cgroup v2 memory.events
    (d / "memory.events").write_text(f"low 0\nhigh 0\nmax 12\noom 1\noom_kill {oom_kills}\noom_group_kill 0\n")
    return tmp_path / "proc", tmp_path / "sys"


def test_sigkill_with_a_new_cgroup_oom_kill_is_named_with_the_fix(tmp_path):
    proc_root, sys_root = _cgroup_v2(tmp_path, 0)
    before = procs.oom_kill_count(proc_root, sys_root)
    _cgroup_v2(tmp_path, 1)
    why = procs.why_killed(4242, -9, before, proc_root, sys_root, kmsg=tmp_path / "no-kmsg")
    assert before == 0 and "killed by SIGKILL, by the kernel's OOM killer (cgroup oom_kill count 0 -> 1)" in why
    assert "memory limit" in why and "NPROC_PER_NODE" in why


def test_sigkill_without_an_oom_kill_says_it_was_not_the_oom_killer(tmp_path):
    proc_root, sys_root = _cgroup_v2(tmp_path, 3)
    why = procs.why_killed(4242, -9, 3, proc_root, sys_root, kmsg=tmp_path / "no-kmsg")
    assert why.startswith("killed by SIGKILL (not the OOM killer")
    assert procs.why_killed(4242, 143, 3, proc_root, sys_root) == "killed by SIGTERM"


def test_the_kernel_log_line_names_the_oom_kill(tmp_path):
    kmsg = tmp_path / "kmsg"  # /dev/kmsg records: "prio,seq,usec,flags;message"
    kmsg.write_text("6,901,2000,-;oom-kill:constraint=CONSTRAINT_MEMCG,task=python,pid=4242,uid=0\n"
                    "3,902,2001,-;Memory cgroup out of memory: Killed process 4242 (python) total-vm:9000kB\n")
    why = procs.why_killed(4242, -9, None, tmp_path / "none", tmp_path / "none", kmsg=kmsg)
    assert "from the kernel's OOM killer (Memory cgroup out of memory: Killed process 4242 (python)" in why
    assert procs.kernel_oom_line(4243, kmsg) is None


def test_an_unreaped_childs_exit_code_is_read_from_proc():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    os.kill(p.pid, signal.SIGKILL)
    time.sleep(0.3)
    assert procs.zombie_exit_code(p.pid) == -9 and not procs.alive(p.pid)
    p.wait()
    q = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    time.sleep(1.0)
    assert procs.zombie_exit_code(q.pid) == 3
    q.wait()


def test_a_worker_killed_by_a_signal_is_reported_by_name(tmp_path):
    """World size 1: the launcher's own child; its exit status gives the signal."""
    lines: list[str] = []
    argv = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    rc = launch.supervise(argv, dict(os.environ), tmp_path / "logs", max_restarts=0, log=lines.append)
    assert rc == 137 and "first failing: rank 0: killed by SIGKILL" in "\n".join(lines)


TREE = textwrap.dedent("""
    import subprocess, sys, time
    # like msrun: a worker in its own session with a helper of its own
    subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                      "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(120)"],
                     start_new_session=True)
    print("ready", flush=True)
    time.sleep(120)
""")


def test_kill_tree_reaches_workers_in_their_own_sessions_and_their_helpers(tmp_path):
    (tmp_path / "tree.py").write_text(TREE)
    p = subprocess.Popen([sys.executable, str(tmp_path / "tree.py")], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    below = procs.descendants(p.pid)
    assert len(below) == 2
    procs.kill_tree(p.pid)
    p.wait()
    time.sleep(0.3)
    assert not [q for q in below if procs.alive(q.pid)]


def test_the_worker_msrun_reported_first_is_named_when_one_poll_finds_several_gone(tmp_path):
    """msrun logs the worker that died, then kills the others itself. When one poll of the launcher
    finds rank 0 (killed by msrun) and rank 1 (reported by msrun) both gone, rank 1 is the first
    failing one, although rank 0 is looked at first (and its missing code waited for)."""
    dead = []
    for _ in range(2):
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        p.kill()
        p.wait()
        dead.append(p.pid)

    class Out:
        codes = {dead[1]: -9}
        reported_at = {dead[1]: time.time()}

    class StillRunning:
        pid = os.getpid()

        def poll(self):
            return None

    job = object.__new__(launch._Attempt)
    job.log_dir, job.ranks, job.scheduler, job.oom_base = tmp_path, [0, 1], None, None
    job.started, job.out, job.proc = time.time(), Out(), StillRunning()
    statuses = {rank: {"state": "running", "pid": pid, "started_at": job.started} for rank, pid in enumerate(dead)}
    failure = job.failure(statuses, stopping=False)
    assert failure is not None and failure.who == "rank 1" and failure.code == -9
    assert failure.why.startswith("killed by SIGKILL")
