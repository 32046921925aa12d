"""launcher/plan.py: the typed plan, its plan.json form and the one place its command is built."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from jobspec.rundir import RunDir
from launcher import launch
from launcher.plan import Plan, Topology


def _plan(tmp_path: Path, world: int = 16, nproc: int = 8, role: str = "worker") -> Plan:
    topology = Topology(world // nproc, 1, nproc, world, "node-0", 8118)
    return Plan({"launch": {"master_addr": "node-0"}}, topology, tmp_path / "plan.json", RunDir(tmp_path), 300,
                role=role)


def test_the_msrun_command_follows_the_plan(tmp_path):
    plan = _plan(tmp_path)
    assert plan.argv == launch.msrun_argv(16, 8, "node-0", 8118, 1, 300, tmp_path / "plan.json", tmp_path / "logs")
    plan.pin_master("10.0.0.1")
    j = plan.to_json()
    argv = j["msrun_argv"]
    assert argv[argv.index("--master_addr") + 1] == "10.0.0.1" == j["recipe"]["launch"]["master_addr"]
    assert j["topology"]["master_host"] == "node-0"
    assert set(j) == {"recipe", "topology", "role", "ranks", "binding", "memory", "msrun_argv", "worker_env",
                      "sources", "run_dir", "model_hash"}
    assert RunDir.from_json(j["run_dir"]) == RunDir(tmp_path) and j["run_dir"]["hf"] == str(tmp_path / "hf")


def test_world_one_starts_the_worker_alone_and_a_scheduler_no_workers(tmp_path):
    assert _plan(tmp_path, 1, 1).argv == launch.direct_argv(tmp_path / "plan.json")
    sched = _plan(tmp_path, role="scheduler")
    sched = dataclasses.replace(sched, topology=dataclasses.replace(sched.topology, nproc_per_node=0))
    argv = sched.argv
    assert argv[argv.index("--worker_num") + 1] == "16" and argv[argv.index("--local_worker_num") + 1] == "0"
