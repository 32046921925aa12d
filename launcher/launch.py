"""msrun argv, the workers' environment, plan.json, and supervision (signals, restarts, log tails)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from jobspec import lifecycle
from jobspec.config import REPO_ROOT
from launcher import procs
from launcher.settings import CPU_MALLOC_DEFAULTS, HCCL_DEFAULTS, HCCL_PASSTHROUGH

WORKER_SCRIPT = REPO_ROOT / "finetune" / "worker.py"


def msrun_argv(world: int, local_workers: int, master_addr: str, master_port: int, node_rank: int,
               cluster_time_out: int, plan_path: Path, log_dir: Path, worker_script: Path = WORKER_SCRIPT,
               msrun: str | None = None, worker_args: list[str] | None = None) -> list[str]:
    """The msrun command as an argument list (never a shell string); the venv's msrun when present. The worker
    gets ``--config plan_path``, or ``worker_args`` when given."""
    venv_msrun = Path(sys.executable).parent / "msrun"
    msrun = msrun or (str(venv_msrun) if venv_msrun.exists() else "msrun")
    return [msrun, "--worker_num", str(world), "--local_worker_num", str(local_workers),
            "--master_addr", master_addr, "--master_port", str(master_port), "--node_rank", str(node_rank),
            "--log_dir", str(log_dir), "--join", "True", "--cluster_time_out", str(cluster_time_out),
            str(worker_script), *(["--config", str(plan_path)] if worker_args is None else worker_args)]


def direct_argv(plan_path: Path, worker_script: Path = WORKER_SCRIPT, python: str = sys.executable) -> list[str]:
    """World size 1: the worker alone, no msrun scheduler process."""
    return [python, str(worker_script), "--config", str(plan_path)]


def worker_env(base: Mapping[str, str], extra: Mapping[str, str], python: str = sys.executable,
               cpu: bool = False) -> dict[str, str]:
    """The environment every worker gets: venv bin first on PATH, repo on PYTHONPATH, HCCL defaults (CPU
    workers: malloc defaults, ``settings.CPU_MALLOC_DEFAULTS``)."""
    env = dict(base)
    bin_dir = str(Path(python).parent)
    env["PATH"] = os.pathsep.join([bin_dir] + [p for p in env.get("PATH", "").split(os.pathsep) if p and p != bin_dir])
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                             if p and p != str(REPO_ROOT)])
    env["PYTHONUNBUFFERED"] = "1"
    for k, v in {**HCCL_DEFAULTS, **(CPU_MALLOC_DEFAULTS if cpu else {})}.items():
        if not env.get(k):
            env[k] = v
    env.update(extra)
    return env


def set_vars(env: Mapping[str, str], base: Mapping[str, str]) -> dict[str, str]:
    """The variables the launcher sets or changes for workers (for the plan and the log)."""
    keep = set(HCCL_PASSTHROUGH)
    return {k: v for k, v in sorted(env.items()) if base.get(k) != v or (k in keep and v)}


def write_plan(path: Path, plan: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(plan, indent=2, default=str))
    tmp.replace(path)


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"({path} is missing)"


class _Output:
    """Copies the job's output to the console and a file; remembers msrun's worker exit codes by pid,
    and when each was reported."""

    def __init__(self, proc: subprocess.Popen, path: Path | None):
        self.codes: dict[int, int] = {}
        self.reported_at: dict[int, float] = {}
        self.thread = threading.Thread(target=self._run, args=(proc, path), daemon=True)
        self.thread.start()

    def _run(self, proc: subprocess.Popen, path: Path | None) -> None:
        f = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            f = open(path, "ab")
        assert proc.stdout is not None  # started with stdout=PIPE
        try:
            for line in iter(proc.stdout.readline, b""):
                m = procs.MSRUN_WORKER_EXIT.search(line.decode(errors="replace"))
                if m:
                    self.reported_at.setdefault(int(m.group(1)), time.time())
                    self.codes[int(m.group(1))] = int(m.group(2))
                sys.stdout.buffer.write(line)
                sys.stdout.flush()
                if f:
                    f.write(line)
                    f.flush()
        finally:
            if f:
                f.close()


@dataclass
class Failure:
    """The first process of the job that failed: who, its exit code, why, its log and the type of the error it
    recorded (jobspec/lifecycle.py; "" where none)."""

    who: str
    code: int
    why: str
    log: Path | None = None
    error: str = ""


class _Attempt:
    """One start of the job: the process, its output, the ranks' status files and msrun's scheduler."""

    def __init__(self, argv: list[str], env: Mapping[str, str], cwd: Path | None, log_dir: Path, ranks: Sequence[int],
                 lock_fd: int | None, under_msrun: bool, tee_to: Path | None, oom_base: int | None) -> None:
        self.started = time.time()
        self.log_dir, self.ranks, self.under_msrun, self.oom_base = log_dir, list(ranks), under_msrun, oom_base
        self.tee_to = tee_to
        death = signal.SIGINT if under_msrun else signal.SIGKILL  # msrun's SIGINT handler kills its workers
        self.proc = subprocess.Popen(argv, env=dict(env), cwd=cwd, start_new_session=True,
                                     preexec_fn=lambda: lifecycle.set_parent_death_signal(death),
                                     pass_fds=(lock_fd,) if lock_fd is not None else (),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.out = _Output(self.proc, tee_to)
        self.known: set[int] = set()  # worker pids seen, killed with the job even after msrun is gone
        self.scheduler: int | None = None

    def statuses(self) -> dict[int, dict]:
        found = lifecycle.read_statuses(self.log_dir, since=self.started - 1)
        st = {r: s for r, s in found.items() if r in self.ranks}
        self.known |= {s["pid"] for s in st.values()}
        if self.scheduler is None and self.under_msrun:
            self.scheduler = procs.find_by_role(self.proc.pid, "MS_SCHED")
        return st

    def workers(self) -> list[int]:
        if not self.under_msrun:
            return [self.proc.pid]
        return procs.group_leaders(self.proc.pid)

    def failure(self, st: dict[int, dict], stopping: bool) -> Failure | None:
        """The earliest failure: a non-zero exit record, a rank gone without one, or a dead scheduler; a rank
        that only lost a peer (``PeerLost``) comes after every other failure."""
        bad = []
        for rank, s in st.items():
            wlog = self.log_dir / f"worker_{rank}.log"
            if s["state"] != "exited" and not procs.alive(s["pid"]):
                s = st[rank] = lifecycle.read_statuses(self.log_dir, self.started - 1).get(rank, s)  # ended meanwhile?
            if s["state"] == "exited":
                if not (s["exit_code"] == 0 or (stopping and s["exit_code"] in (130, 143))):
                    err = s.get("error")
                    why = f"{err['type']}: {err['message']}" if err else f"exit code {s['exit_code']}"
                    consequence = err is not None and err["type"] == lifecycle.PeerLost.__name__
                    bad.append(((consequence, s["ended_at"]), Failure(f"rank {rank}", s["exit_code"], why, wlog,
                                                                      err["type"] if err else "")))
            elif not procs.alive(s["pid"]):
                code = self._exit_code(s["pid"])
                if code == 0 or (stopping and code is not None and procs.signal_name(code) in ("SIGTERM", "SIGINT")):
                    continue
                # msrun reports the worker that died first, then kills the others itself: when
                # several are gone by this poll, the time of msrun's report orders them
                when = self.out.reported_at.get(s["pid"], time.time())
                bad.append(((False, when), Failure(f"rank {rank}", code if code is not None else -9,
                                                 self._why_killed(s["pid"], code), wlog)))
        ended = all(s["state"] == "exited" or not procs.alive(s["pid"]) for s in st.values())
        all_done = ended and len(st) == len(self.ranks)
        if not bad and self.scheduler and not procs.alive(self.scheduler) and not all_done:
            code = procs.zombie_exit_code(self.scheduler)
            if code == 0:  # it ends cleanly only after every worker did
                return None
            why = self._why_killed(self.scheduler, code) if code is not None and code < 0 else \
                f"exit code {code}" if code is not None else "it is gone"
            bad.append(((False, time.time()), Failure(f"msrun's scheduler (pid {self.scheduler})", code or -9,
                                             f"{why}; the ranks cannot continue without it",
                                             self.log_dir / "scheduler.log")))
        return min(bad, key=lambda b: b[0])[1] if bad else None

    def _exit_code(self, pid: int, wait_s: float = 1.5) -> int | None:
        """An unreaped worker's status, else msrun's logged exit code (it polls once a second)."""
        code = procs.zombie_exit_code(pid)
        deadline = time.monotonic() + wait_s
        while code is None and pid not in self.out.codes and time.monotonic() < deadline and self.proc.poll() is None:
            time.sleep(0.05)
            code = procs.zombie_exit_code(pid)
        return code if code is not None else self.out.codes.get(pid)

    def _why_killed(self, pid: int, code: int | None) -> str:
        if code is None:
            return "its process vanished without an exit record (killed by a signal; msrun did not log the code)"
        if code >= 0:
            return f"exit code {code} without an exit record (the process ended before its status was written)"
        return procs.why_killed(pid, code, self.oom_base)

    def direct_failure(self, rc: int) -> Failure | None:
        """World size 1: the worker is our child, its exit status is ours to read."""
        if rc == 0:
            return None
        s = lifecycle.read_statuses(self.log_dir, since=self.started - 1).get(0, {})
        err = s.get("error")
        why = f"{err['type']}: {err['message']}" if err else \
            procs.why_killed(self.proc.pid, rc, self.oom_base) if rc < 0 else f"exit code {rc}"
        return Failure("rank 0", rc, why, self.tee_to, err["type"] if err else "")

    def kill(self) -> None:
        procs.kill_tree(self.proc.pid, [p for p in self.known if procs.alive(p)])
        self.proc.wait()
        self.out.thread.join(timeout=5)


def supervise(argv: list[str], env: Mapping[str, str], log_dir: Path, max_restarts: int, cwd: Path | None = None,
              log: Callable[[str], None] = print, restart_delay_s: float = 1.0, tee_to: Path | None = None,
              under_msrun: bool = False, ranks: Sequence[int] = (0,), lock_fd: int | None = None,
              poll_s: float = 0.2, finish_grace_s: float = 30.0) -> int:
    """Run the job in its own process group; watch its ranks; forward SIGTERM/SIGINT; restart.

    Every child dies with the launcher (a parent-death signal; msrun gets SIGINT, whose handler kills
    its workers) and the whole tree is killed when this returns. A failed rank (an exit record with a
    non-zero code, or a worker gone without one) ends the job at once, the rank named with its error
    or signal. SIGTERM/SIGINT go to the workers only (they checkpoint and exit 143); once they are
    gone the scheduler is killed; a second signal kills everything. Each restart resumes from the
    newest checkpoint. ``tee_to``: also copy the output here. Returns the job's exit code.
    """
    attempt_no, stopping = 0, {"sig": None, "count": 0}
    job: _Attempt | None = None

    def forward(signum, _frame):
        stopping["sig"], stopping["count"] = signum, stopping["count"] + 1
        if job is None or job.proc.poll() is not None:
            return
        if stopping["count"] > 1:
            log(f"second {signal.Signals(signum).name}: killing the job")
            job.kill()
            return
        pids = job.workers()
        if pids and job.under_msrun:
            procs.signal_pids(pids, signum)
        else:
            procs.signal_group(job.proc.pid, signum)

    env = {**env, lifecycle.LAUNCHER_PID_ENV: str(os.getpid())}
    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            job = _Attempt(argv, env, cwd, log_dir, ranks, lock_fd, under_msrun, tee_to, procs.oom_kill_count())
            rc, failure = _watch(job, stopping, poll_s, finish_grace_s)
            if stopping["sig"] is not None:
                sig = signal.Signals(stopping["sig"]).name
                log(f"stopped by {sig}; exit code {rc}" + (f" ({failure.who}: {failure.why})" if failure else ""))
                return rc
            if failure is None and rc == 0:
                return 0
            if failure is not None:
                last = tail(failure.log) if failure.log else ""
                log(f"the job failed (exit code {rc}); first failing: {failure.who}: {failure.why}" +
                    (f"\nlast lines of {failure.log}:\n{last}" if last.strip() else ""))
            else:
                log(f"the job failed (exit code {rc}) and no rank recorded an error; see {log_dir}")
            if attempt_no >= max_restarts:
                if max_restarts:
                    log(f"giving up after {max_restarts} restart(s)")
                return rc
            if failure is not None and failure.error == lifecycle.DeviceOutOfMemory.__name__:
                log("not restarted: the same layout and recipe run out of device memory again; change what the "
                    "error names")
                return rc
            attempt_no += 1
            log(f"restart {attempt_no}/{max_restarts}: resuming from the newest checkpoint")
            time.sleep(restart_delay_s)
    finally:
        if job is not None and job.proc.poll() is None:
            job.kill()
        for s, h in old.items():
            signal.signal(s, h)


def _watch(job: _Attempt, stopping: dict, poll_s: float, finish_grace_s: float,
           stop_grace_s: float = 2.0) -> tuple[int, Failure | None]:
    """Until the job ends, a rank fails, or (stopping) every rank is gone; returns (exit code, failure)."""
    rc: int | None  # poll() below: None while the job runs
    if not job.under_msrun:
        rc = job.proc.wait()
        job.out.thread.join(timeout=5)
        failure = job.direct_failure(rc) if stopping["sig"] is None else None
        return (128 - rc if rc < 0 else rc), failure
    done_since = stopped_since = None
    while True:
        rc = job.proc.poll()
        st = job.statuses()
        failure = job.failure(st, stopping["sig"] is not None)
        if failure is not None:
            job.kill()
            return (128 - failure.code if failure.code < 0 else failure.code), failure
        ended = [s for s in st.values() if s["state"] == "exited" or not procs.alive(s["pid"])]
        all_ended = bool(job.ranks) and len(ended) == len(job.ranks)  # no ranks here: msrun's scheduler alone
        if rc is not None:
            job.out.thread.join(timeout=5)
            codes = [s.get("exit_code", 0) for s in ended]
            return (max(codes) if all_ended and codes else rc), None
        if stopping["sig"] is not None and (all_ended or not any(procs.alive(p) for p in job.workers())):
            stopped_since = stopped_since or time.monotonic()
            if time.monotonic() - stopped_since > stop_grace_s:  # msrun would wait for its scheduler's timeout
                job.kill()
                codes = [s.get("exit_code", 128 + stopping["sig"]) for s in ended]
                return max(codes, default=128 + stopping["sig"]), None
        if all_ended:  # every rank finished: give msrun and its scheduler a moment to exit by themselves
            done_since = done_since or time.monotonic()
            if time.monotonic() - done_since > finish_grace_s:
                job.kill()
                return 0, None
        time.sleep(poll_s)
