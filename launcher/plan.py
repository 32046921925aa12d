"""The launcher's plan: every decision of one node's job as a typed record, written to plan.json.

The JSON keeps its keys (``recipe``, ``topology``, ``role``, ``ranks``, ``binding``, ``memory``,
``msrun_argv``, ``worker_env``, ``sources``, ``run_dir``, ``model_hash``); the workers read ``recipe``,
``run_dir`` (every path of the run, :class:`jobspec.rundir.RunDir`: the launcher decides, the workers read)
and ``model_hash``. The command that starts the job is built here from the plan, in one place
(:attr:`Plan.argv`): the worker alone for world size 1, else msrun, whose ``--local_worker_num`` is 0 on an
AscendJob Scheduler pod (``role == "scheduler"``, launcher/ascendjob.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from jobspec.rundir import RunDir
from launcher import launch

Role = Literal["worker", "scheduler"]


@dataclass
class Topology:
    """Where the ranks run: nodes, this node's workers, the master. How the ranks split the model (tp, dp, pp)
    is the recipe's ``layout`` (jobspec.layout.Layout), decided once and not repeated here."""

    nnodes: int
    node_rank: int
    nproc_per_node: int  # workers this node starts (0 on a Scheduler pod)
    world_size: int
    master_addr: str
    master_port: int
    master_host: str = ""  # MASTER_ADDR as given, when the launcher resolved it to master_addr


@dataclass
class Plan:
    recipe: dict[str, Any]  # the resolved recipe the workers load (jobspec.config.to_dict form)
    topology: Topology
    path: Path  # where plan.json is written (the workers' --config)
    run_dir: RunDir  # every path of the run, the token cache's included
    cluster_time_out: int
    role: Role = "worker"
    ranks: list[dict[str, Any]] = field(default_factory=list)
    binding: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)
    worker_env: dict[str, str] = field(default_factory=dict)
    sources: dict[str, Any] = field(default_factory=dict)
    model_hash: str = ""  # the base model's identity, hashed once per node (the workers' run identity)

    @property
    def argv(self) -> list[str]:
        """The job's command: the worker alone (world 1), else msrun with this node's workers."""
        t = self.topology
        if t.world_size == 1 and self.role == "worker":
            return launch.direct_argv(self.path)
        return launch.msrun_argv(t.world_size, t.nproc_per_node, t.master_addr, t.master_port, t.node_rank,
                                 self.cluster_time_out, self.path, self.run_dir.logs)

    def pin_master(self, ip: str) -> None:
        """MASTER_ADDR's name resolved: the address goes to msrun and the workers' recipe."""
        self.topology.master_host, self.topology.master_addr = self.topology.master_addr, ip
        self.recipe["launch"]["master_addr"] = ip

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("path", "cluster_time_out")}
        d["topology"], d["run_dir"] = dataclasses.asdict(self.topology), self.run_dir.to_json()
        return {**d, "msrun_argv": self.argv}
