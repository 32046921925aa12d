"""Process handling for supervision: the job's process tree, killing it whole, and why a worker died.

msrun 2.10 runs its scheduler and ``tail -f`` log followers in its own process group and starts every
worker with ``setsid`` (a process group of its own, also holding the worker's helpers). Killing the
job therefore means msrun's group plus each worker's group.
"""
from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterable
from pathlib import Path

import psutil

# msrun's join loop: logger.error(f"Worker process {p.pid} exit with exception. Error code: {ret_code}.")
MSRUN_WORKER_EXIT = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def group_leaders(pid: int) -> list[int]:
    """Descendants of ``pid`` that lead their own process group (msrun's workers), not in pid's group."""
    own = _pgid(pid)
    return [p.pid for p in descendants(pid) if _pgid(p.pid) == p.pid and p.pid != own]


def signal_pids(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(root: int, extra: Iterable[int] = ()) -> None:
    """SIGKILL ``root``'s process group, every process group below it, and ``extra`` pids' groups."""
    groups = {root} | {g for g in (_pgid(p.pid) for p in descendants(root)) if g} | \
             {g for g in (_pgid(p) for p in extra) if g}
    pids = [p.pid for p in descendants(root)] + list(extra)
    for g in groups - {os.getpgid(0)}:
        signal_group(g, signal.SIGKILL)
    signal_pids(pids, signal.SIGKILL)


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent to reap it counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def zombie_exit_code(pid: int, proc_root: Path = Path("/proc")) -> int | None:
    """The exit code of an unreaped child of another process (negative: its signal), else None."""
    try:
        text = (proc_root / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    if fields[0] != "Z" or len(fields) < 50:
        return None
    status = int(fields[-1])
    return -(status & 0x7F) if status & 0x7F else status >> 8


def find_by_role(root: int, role: str) -> int | None:
    """A descendant of ``root`` whose environment has ``MS_ROLE=role`` (msrun's scheduler: MS_SCHED)."""
    for p in descendants(root):
        try:
            if p.environ().get("MS_ROLE") == role:
                return p.pid
        except psutil.Error:
            continue
    return None


def signal_name(code: int) -> str | None:
    """'SIGKILL' for a waitpid-style -9 (or a shell-style 137); None for an ordinary exit code."""
    num = -code if code < 0 else code - 128 if 128 < code < 128 + 65 else 0
    try:
        return signal.Signals(num).name if num else None
    except ValueError:
        return None


def _cgroup_dirs(proc_root: Path, sys_root: Path) -> list[Path]:
    """This process's memory cgroup directories (v2 unified, v1 memory controller)."""
    try:
        lines = (proc_root / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":
            out.append(sys_root / "fs" / "cgroup" / rel)
        elif "memory" in controllers.split(","):
            out.append(sys_root / "fs" / "cgroup" / "memory" / rel)
    return out


def oom_kill_count(proc_root: Path = Path("/proc"), sys_root: Path = Path("/sys")) -> int | None:
    """The ``oom_kill`` counter of this process's memory cgroup (memory.events, v1 memory.oom_control)."""
    for d in _cgroup_dirs(proc_root, sys_root):
        for name in ("memory.events", "memory.oom_control"):
            try:
                text = (d / name).read_text()
            except OSError:
                continue
            m = re.search(r"^oom_kill (\d+)$", text, re.M)
            if m:
                return int(m.group(1))
    return None


def kernel_oom_line(pid: int, kmsg: Path = Path("/dev/kmsg")) -> str | None:
    """The kernel log's 'Killed process <pid>' line, when the log is readable (root, no dmesg_restrict)."""
    try:
        fd = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    found = None
    try:
        while True:
            try:
                rec = os.read(fd, 8192).decode(errors="replace")
            except BlockingIOError:
                break
            except OSError:  # EPIPE: a record was overwritten while reading; go on
                continue
            if not rec:
                break
            for line in rec.splitlines():  # one record per read from /dev/kmsg, "prio,seq,usec,flags;message"
                killed = re.search(rf"Killed process {pid}\b", line)
                if killed or (not found and re.search(rf"oom-kill:.*pid={pid}\b", line)):
                    found = line.split(";", 1)[-1].strip()
    finally:
        os.close(fd)
    return found


OOM_FIX = ("the host ran out of memory for this job: raise the container/pod memory limit (docker --memory, "
           "resources.limits.memory), run fewer workers per node (NPROC_PER_NODE), or lower "
           "data.num_workers, train.micro_batch_size or data.seq_len")


def why_killed(pid: int, code: int, oom_before: int | None, proc_root: Path = Path("/proc"),
               sys_root: Path = Path("/sys"), kmsg: Path = Path("/dev/kmsg")) -> str:
    """'killed by SIGKILL' plus, for SIGKILL, whether the OOM killer did it (and the fix)."""
    name = signal_name(code) or f"exit code {code}"
    text = f"killed by {name}"
    if name != "SIGKILL":
        return text
    line = kernel_oom_line(pid, kmsg)
    after = oom_kill_count(proc_root, sys_root)
    if line:
        return f"{text} from the kernel's OOM killer ({line}); {OOM_FIX}"
    if oom_before is not None and after is not None and after > oom_before:
        return f"{text}, by the kernel's OOM killer (cgroup oom_kill count {oom_before} -> {after}); {OOM_FIX}"
    return f"{text} (not the OOM killer as far as the cgroup's memory events and kernel log show: another " \
           f"process or the operator sent it)"
