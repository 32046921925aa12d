"""Start the real launcher on the tiny model (2 CPU workers under msrun), wait for a step, inject a fault."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from msrun_helpers import free_port

REPO = Path(__file__).resolve().parents[2]
TINY = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "tie_word_embeddings": True}


def overrides(port: int) -> list[str]:
    return ["train.save_every=2", "train.keep_checkpoints=2", "data.max_samples=48", "data.seq_len=64",
            "train.micro_batch_size=1", f"launch.master_port={port}", "launch.max_restarts=0",
            "launch.cluster_time_out=120"]


class Job:
    """One `python -m launcher train` in its own session, output in <out>.console.log."""

    def __init__(self, out: Path, model: Path, name: str = "run", nproc: int = 2, extra: list[str] = (),
                 port: int | None = None):
        self.out, self.console = out, out.parent / f"{out.name}.{name}.log"
        env = {**os.environ, "PYTHONPATH": str(REPO), "MODEL_DIR": str(model), "OUTPUT_DIR": str(out),
               "NPROC_PER_NODE": str(nproc), "GLOG_v": "3",
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        with open(self.console, "wb") as f:
            argv = [sys.executable, "-m", "launcher", "train", *overrides(port or free_port()), *extra]
            self.proc = subprocess.Popen(argv, env=env, cwd=out.parent, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def text(self) -> str:
        return self.console.read_text(errors="replace")

    def wait_step(self, step: int, timeout: float = 300) -> None:
        """Until rank 0 logged ``step`` (a progress line), or fail with the console tail."""
        deadline = time.monotonic() + timeout
        pat = re.compile(rf"^step +{step}/", re.M)
        while not pat.search(self.text()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no step {step} (rc {self.proc.poll()}):\n{self.text()[-3000:]}")
            time.sleep(0.2)

    def wait(self, timeout: float = 600) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise AssertionError(f"launcher still running after {timeout}s:\n{self.text()[-3000:]}") from None

    def kill_all(self) -> None:
        for p in [self.proc.pid] + [q.pid for q in leftovers(self.out)]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def leftovers(out: Path) -> list[psutil.Process]:
    """Processes of a job on ``out`` (msrun, scheduler, workers, log tails name it on their command line)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if str(out) in cmd and p.info["status"] != psutil.STATUS_ZOMBIE and p.pid != os.getpid():
            found.append(p)
    return found


def scheduler_pid(job: Job) -> int:
    """msrun's scheduler: the child of msrun running the worker script with MS_ROLE=MS_SCHED."""
    for p in psutil.Process(job.proc.pid).children(recursive=True):
        try:
            if p.environ().get("MS_ROLE") == "MS_SCHED":
                return p.pid
        except psutil.Error:
            continue
    raise AssertionError("no scheduler process found")
