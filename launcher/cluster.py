"""Where the cluster comes from: explicit env, Volcano, AscendJob, torchrun/Kubeflow, a hostfile.

Sources are tried in that order; the first that applies wins and says why. Every probe takes
its env, paths and this host's names/addresses as parameters so tests can feed recorded values.
"""
from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from launcher.settings import env_value


@dataclass
class Cluster:
    """Node-level topology; ``nproc_per_node`` is None when the source does not say."""

    source: str
    reason: str
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    nproc_per_node: int | None = None
    hosts: list[str] = field(default_factory=list)
    rank_table: str | None = None
    role: str = "worker"  # "scheduler": an AscendJob Scheduler pod (MS_ROLE=MS_SCHED), see launcher/ascendjob.py

    def overrides(self) -> dict[str, str]:
        """The launch.* values this source determines (lower precedence than user settings)."""
        if self.source in ("env", "single"):  # the env contract / the recipe already says it all
            return {}
        out = {"launch.nnodes": str(self.nnodes), "launch.node_rank": str(self.node_rank),
               "launch.master_addr": self.master_addr}
        if self.master_port is not None:
            out["launch.master_port"] = str(self.master_port)
        if self.nproc_per_node is not None:
            out["launch.nproc_per_node"] = str(self.nproc_per_node)
        return out


class ClusterError(ValueError):
    """The scheduler's variables are inconsistent; the message names them and the fix."""


def own_identities() -> set[str]:
    """This host's names and addresses (hostname, FQDN, resolved IPs, every interface's address)."""
    import psutil

    names = {socket.gethostname(), socket.getfqdn(), "localhost", "127.0.0.1"}
    for n in list(names):
        try:
            names.update(str(i[4][0]) for i in socket.getaddrinfo(n, None))
        except OSError:
            pass
    names.update(a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
                 if a.family in (socket.AF_INET, socket.AF_INET6))
    return {n for n in names if n}


def _int(env: Mapping[str, str], name: str) -> int:
    v = env_value(env, name)
    try:
        return int(v or "")
    except ValueError:
        raise ClusterError(f"{name}={v!r}: expected an integer (e.g. {name}=1)") from None


def _matches(host: str, me: set[str]) -> bool:
    return host in me or host.split(".")[0] in {m.split(".")[0] for m in me if not m[0].isdigit()}


def from_explicit(env: Mapping[str, str], hostfile: str | None = None) -> Cluster | None:
    """NNODES / NODE_RANK set by the user (MASTER_ADDR alone too, unless torchrun variables exist).

    With a hostfile the hostfile describes the cluster (NODE_RANK then picks this node's line).
    """
    if hostfile:
        return None
    torch_vars = any(env_value(env, v) for v in ("WORLD_SIZE", "RANK", "PET_NNODES", "PET_NODE_RANK"))
    if not (env_value(env, "NNODES") or env_value(env, "NODE_RANK")
            or (env_value(env, "MASTER_ADDR") and not torch_vars)):
        return None
    nnodes = env_value(env, "NNODES") or "1"
    rank_from = ("NODE_RANK", "RANK", "PET_NODE_RANK", "VC_TASK_INDEX", "HOSTFILE")
    if nnodes.isdigit() and int(nnodes) > 1 and env_value(env, "MASTER_ADDR") \
            and not any(env_value(env, v) for v in rank_from):
        raise ClusterError(f"NODE_RANK: NNODES={nnodes} with MASTER_ADDR needs this node's rank: set NODE_RANK="
                           f"<0..{int(nnodes) - 1}> (docker: -e NODE_RANK=1), 0 on the MASTER_ADDR node")
    set_vars = [v for v in ("NNODES", "NODE_RANK", "MASTER_ADDR") if env_value(env, v)]
    # The values themselves reach the recipe through the env contract (and are validated there).
    return Cluster("env", f"explicit {', '.join(set_vars)} in the environment")


def _volcano_hosts(env: Mapping[str, str], volcano_dir: Path) -> dict[str, list[str]]:
    tasks: dict[str, list[str]] = {}
    for k, v in env.items():
        m = re.fullmatch(r"VC_(.+)_HOSTS", k)
        if m and v:
            tasks[m.group(1).lower().replace("_", "-")] = [h for h in v.split(",") if h]
    if not tasks and volcano_dir.is_dir():
        for f in sorted(volcano_dir.glob("*.host")):
            tasks[f.stem] = [h.strip() for h in f.read_text().splitlines() if h.strip()]
    return tasks


def from_volcano(env: Mapping[str, str], me: set[str], volcano_dir: Path = Path("/etc/volcano")) -> Cluster | None:
    """Volcano's env + svc plugins: VC_TASK_INDEX is the index inside this pod's task."""
    if env_value(env, "VC_TASK_INDEX") is None:
        return None
    tasks = _volcano_hosts(env, volcano_dir)
    if not tasks:
        raise ClusterError("VC_TASK_INDEX is set but no VC_<TASK>_HOSTS variables or /etc/volcano/<task>.host "
                           "files: enable the svc plugin in the Volcano Job (plugins: {svc: [], env: []})")
    order = sorted(tasks, key=lambda t: (t not in ("master", "scheduler", "chief"), t))
    hosts = [h for t in order for h in tasks[t]]
    index = _int(env, "VC_TASK_INDEX")
    mine = [i for i, h in enumerate(hosts) if _matches(h, me)]
    if mine:
        rank, how = mine[0], "matched this pod's hostname"
    elif len(tasks) == 1:
        rank, how = index, "VC_TASK_INDEX inside the only task"
    else:
        raise ClusterError(f"Volcano: this pod's hostname ({sorted(me)[0]}) is in none of the task host lists "
                           f"({', '.join(order)}); VC_TASK_INDEX={index} only counts inside one task")
    for t in order:
        n = env_value(env, f"VC_{t.upper().replace('-', '_')}_NUM")
        if n is not None and n.isdigit() and int(n) != len(tasks[t]):
            raise ClusterError(f"Volcano: VC_{t.upper()}_NUM={n} but VC_{t.upper()}_HOSTS lists {len(tasks[t])} "
                               "hosts; wait for all pods (minAvailable = replicas)")
    port = _int(env, "MASTER_PORT") if env_value(env, "MASTER_PORT") else None
    return Cluster("volcano", f"Volcano tasks {', '.join(order)}; node rank {rank}: {how}", nnodes=len(hosts),
                   node_rank=rank, master_addr=hosts[0], master_port=port, hosts=hosts)


def wait_rank_table(path: Path, timeout_s: float = 600.0, poll_s: float = 2.0,
                    sleep: Callable[[float], None] = time.sleep) -> dict:
    """Wait until the AscendJob operator's hccl.json says ``"status": "completed"``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            table = json.loads(path.read_text())
            if table.get("status") == "completed":
                return table
        except (OSError, json.JSONDecodeError):
            pass
        if time.monotonic() >= deadline:
            raise ClusterError(f"RANK_TABLE_FILE={path}: status not 'completed' after {timeout_s:.0f}s; check the "
                               "AscendJob operator (ascend-operator) and the hccl.json volume mount")
        sleep(poll_s)


def from_ascendjob(env: Mapping[str, str], rank_table_timeout_s: float = 600.0,
                   sleep: Callable[[float], None] = time.sleep) -> Cluster | None:
    """Ascend's AscendJob operator: MS_WORKER_NUM counts NPUs in the job, MS_LOCAL_WORKER per worker pod.

    MS_ROLE says the pod's replica: MS_SCHED (the Scheduler pod, MS_SCHED_HOST its own IP) or MS_WORKER
    (MS_SCHED_HOST the scheduler Service's IP, MS_NODE_RANK its index = msrun's --node_rank).
    """
    if env_value(env, "MS_SCHED_HOST") is None or env_value(env, "MS_WORKER_NUM") is None:
        return None
    total, local = _int(env, "MS_WORKER_NUM"), _int(env, "MS_LOCAL_WORKER")
    if local <= 0 or total % local:
        raise ClusterError(f"MS_WORKER_NUM={total} is not a multiple of MS_LOCAL_WORKER={local}")
    role = {"MS_SCHED": "scheduler", "MS_WORKER": "worker", None: "worker"}.get(env_value(env, "MS_ROLE"))
    if role is None:
        raise ClusterError(f"MS_ROLE={env['MS_ROLE']!r}: expected MS_SCHED or MS_WORKER (set by ascend-operator "
                           "for the Scheduler and Worker replicas of a framework: mindspore AscendJob)")
    table = env_value(env, "RANK_TABLE_FILE")
    if table:
        wait_rank_table(Path(table), rank_table_timeout_s, sleep=sleep)
    return Cluster("ascendjob", f"AscendJob {role} pod: MS_WORKER_NUM={total} NPUs / MS_LOCAL_WORKER={local} per "
                   f"worker pod, MS_NODE_RANK={env_value(env, 'MS_NODE_RANK')}",
                   nnodes=total // local, node_rank=_int(env, "MS_NODE_RANK"),
                   master_addr=env["MS_SCHED_HOST"], master_port=_int(env, "MS_SCHED_PORT"),
                   nproc_per_node=local, rank_table=table, role=role)


def from_torchrun(env: Mapping[str, str]) -> Cluster | None:
    """torchrun / Kubeflow PyTorchJob: WORLD_SIZE and RANK count nodes (pods), PET_* win."""
    nnodes = env_value(env, "PET_NNODES") or env_value(env, "WORLD_SIZE")
    if nnodes is None or env_value(env, "MASTER_ADDR") is None:
        return None
    if ":" in nnodes:  # elastic "min:max"
        nnodes = nnodes.split(":")[-1]
    rank_var = "PET_NODE_RANK" if env_value(env, "PET_NODE_RANK") else "RANK"
    nproc = env_value(env, "PET_NPROC_PER_NODE")
    return Cluster("torchrun", f"torchrun/Kubeflow variables (nodes from "
                   f"{'PET_NNODES' if env_value(env, 'PET_NNODES') else 'WORLD_SIZE'}, rank from {rank_var})",
                   nnodes=int(nnodes), node_rank=_int(env, rank_var) if env_value(env, rank_var) else 0,
                   master_addr=env["MASTER_ADDR"],
                   master_port=_int(env, "MASTER_PORT") if env_value(env, "MASTER_PORT") else None,
                   nproc_per_node=int(nproc) if nproc and nproc.isdigit() else None)


def parse_hostfile(path: Path) -> list[tuple[str, int | None]]:
    """``host slots=N`` lines (MPI's ``host:N`` too; ``#`` comments, blank lines allowed) -> [(host, slots)].

    Every node runs the same number of workers (world = nodes x workers per node: global ranks, the layout and
    msrun's --worker_num are derived from it), so slots that differ between lines are refused on every node."""
    out: list[tuple[str, int | None]] = []
    seen: dict[str, int] = {}
    for no, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        mpi = re.fullmatch(r"([^:\s]+):(\d+)", parts[0])  # MPI's "node-a:8" (not an IPv6 address)
        if mpi:
            parts[:1] = [mpi.group(1), f"slots={mpi.group(2)}"]
        if parts[0] in seen:  # msrun would plan two nodes and fail in its scheduler much later
            raise ClusterError(f"{path}: host {parts[0]} is listed twice (line {seen[parts[0]]} and line {no}); "
                               f"list each node once, its NPUs as slots=N (e.g. '{parts[0]} slots=8')")
        seen[parts[0]] = no
        slots = None
        for p in parts[1:]:
            m = re.fullmatch(r"slots=(\d+)", p)
            if not m:
                raise ClusterError(f"{path}:{no}: {p!r} is not 'slots=N'; write e.g. 'node-a slots=8'")
            slots = int(m.group(1))
        out.append((parts[0], slots))
    if not out:
        raise ClusterError(f"{path}: no hosts; write one 'host slots=N' line per node")
    _same_slots(path, out)
    return out


def _same_slots(path: Path, entries: list[tuple[str, int | None]]) -> None:
    """Refuse a hostfile whose nodes would start different numbers of workers (each node would plan its own world)."""
    given = {slots for _, slots in entries}
    if len(given) > 1:
        counts = ", ".join(f"{h} slots={'(none)' if n is None else n}" for h, n in entries)
        low = min((n for n in given if n is not None), default=1)
        raise ClusterError(f"{path}: the nodes have different slots ({counts}); every node must run the same "
                           f"number of workers (world = nodes x slots): give every line the same slots, e.g. "
                           f"'{entries[0][0]} slots={low}' and '{entries[-1][0]} slots={low}'")


def from_hostfile(hostfile: str | None, me: set[str], node_rank: int | None = None) -> Cluster | None:
    """A hostfile: the first host is the master; this node is line ``node_rank`` (NODE_RANK) when given,
    else the line matching one of its names/addresses."""
    if not hostfile:
        return None
    path = Path(hostfile)
    if not path.is_file():
        raise ClusterError(f"HOSTFILE={hostfile}: no such file; point it at e.g. hostfiles/two-nodes.txt")
    entries = parse_hostfile(path)
    if node_rank is not None and not 0 <= node_rank < len(entries):
        raise ClusterError(f"NODE_RANK={node_rank}: HOSTFILE={hostfile} lists {len(entries)} node(s); "
                           f"use 0..{len(entries) - 1}")
    mine = [node_rank] if node_rank is not None else [i for i, (h, _) in enumerate(entries) if _matches(h, me)]
    if not mine:
        raise ClusterError(f"HOSTFILE={hostfile}: none of its hosts ({', '.join(h for h, _ in entries)}) is this "
                           f"machine ({', '.join(sorted(me))}); list this host's name or address, or set NODE_RANK")
    me_entry = entries[mine[0]][0]
    how = "NODE_RANK" if node_rank is not None else "matched this host's names/addresses"
    return Cluster("hostfile", f"{hostfile}: this host is entry {mine[0] + 1} of {len(entries)} ({me_entry}, {how})",
                   nnodes=len(entries), node_rank=mine[0], master_addr=entries[0][0],
                   nproc_per_node=entries[mine[0]][1],
                   hosts=[h for h, _ in entries])


def detect(env: Mapping[str, str], hostfile: str | None = None, me: set[str] | None = None,
           volcano_dir: Path = Path("/etc/volcano"), rank_table_timeout_s: float = 600.0,
           sleep: Callable[[float], None] = time.sleep) -> Cluster:
    """The first source that applies, in the documented order; a single node when none does."""
    me = own_identities() if me is None else me
    hostfile = hostfile or env_value(env, "HOSTFILE")
    rank = _int(env, "NODE_RANK") if hostfile and env_value(env, "NODE_RANK") else None
    for probe in (lambda: from_explicit(env, hostfile), lambda: from_volcano(env, me, volcano_dir),
                  lambda: from_ascendjob(env, rank_table_timeout_s, sleep), lambda: from_torchrun(env),
                  lambda: from_hostfile(hostfile, me, rank)):
        found = probe()
        if found is not None:
            return found
    return Cluster("single", "no cluster variables, Volcano files or hostfile: one node")
