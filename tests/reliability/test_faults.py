"""Fault injection on the real launcher: 2 CPU workers under msrun, the tiny model, one OUTPUT_DIR.

One chain of runs: kill -9 a worker, kill -9 msrun's scheduler, SIGTERM the launcher, kill -9 the
launcher, each at a random step after the previous run's checkpoint, each followed by a rerun;
the last rerun finishes. Its export must be byte-identical to an uninterrupted run's, every fault
must end the job within seconds, and no process of the job may outlive the launcher.
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from pathlib import Path

import jobs
import pytest

from jobspec.tiny import ensure_tiny_model

pytestmark = pytest.mark.slow
STEPS = 10


def _export(out: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted((out / "hf").glob("*.safetensors"))}


def _rank_pid(out: Path, rank: int, since: float) -> int:
    path = out / "logs" / "ranks" / f"rank_{rank:05d}.json"
    s = json.loads(path.read_text())
    assert s["started_at"] >= since and s["state"] == "running"
    return s["pid"]


def _no_leftovers(out: Path, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while jobs.leftovers(out) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not jobs.leftovers(out), [p.cmdline() for p in jobs.leftovers(out)]


@pytest.fixture(scope="module")
def model(module_tmp) -> Path:
    path = module_tmp / "tiny"
    ensure_tiny_model(path, jobs.TINY, 0)
    return path


def test_every_fault_then_a_rerun_gives_the_uninterrupted_export(model, tmp_path):
    ref = tmp_path / "reference"
    job = jobs.Job(ref, model, extra=[f"train.max_steps={STEPS}"])
    assert job.wait() == 0, job.text()[-3000:]
    reference = _export(ref)
    assert reference

    out, rng, port = tmp_path / "out", random.Random(), jobs.free_port()  # every rerun on the same port
    for n, fault in enumerate(["worker", "scheduler", "sigterm", "launcher"]):
        job = jobs.Job(out, model, name=f"{n}-{fault}", extra=[f"train.max_steps={STEPS}"], port=port)
        start = time.time()
        job.wait_step(_first_step(job) + rng.randint(0, 1))
        at = time.monotonic()
        if fault == "worker":
            os.kill(_rank_pid(out, 1, start), signal.SIGKILL)
        elif fault == "scheduler":
            os.kill(jobs.scheduler_pid(job), signal.SIGKILL)
        elif fault == "sigterm":
            os.kill(job.proc.pid, signal.SIGTERM)
        else:
            os.kill(job.proc.pid, signal.SIGKILL)
            job.proc.wait()
            _no_leftovers(out, within_s=5)
            continue
        rc = job.wait(timeout=120)
        took = time.monotonic() - at
        text = job.text()
        if fault == "sigterm":
            assert rc == 143 and "stopped by SIGTERM; exit code 143" in text, text[-3000:]
            assert re.search(r"stop requested: checkpoint at step \d+ written", text), text[-3000:]
            assert "Traceback" not in text
        else:
            who = "rank 1" if fault == "worker" else "msrun's scheduler"
            assert rc == 137 and f"first failing: {who}" in text and "killed by SIGKILL" in text, text[-3000:]
            assert took < 15, f"{fault}: the launcher took {took:.1f}s to stop the job"
        _no_leftovers(out, within_s=1)

    final = jobs.Job(out, model, name="final", extra=[f"train.max_steps={STEPS}"], port=port)
    assert final.wait() == 0, final.text()[-3000:]
    assert "taking over the lock" in final.text()
    assert _export(out) == reference
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))


def _first_step(job: jobs.Job) -> int:
    """The first step this run trains (one past the checkpoint it resumed from)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        text = job.text()
        m = re.search(r"resumed from \S+ at step (\d+)", text)
        if m:
            return int(m.group(1)) + 1
        if re.search(r"^step +1/", text, re.M):
            return 1
        if job.proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"the run never started training:\n{job.text()[-3000:]}")
