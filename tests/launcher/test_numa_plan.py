"""NUMA binding plans on fake sysfs trees: 2 and 8 NUMA nodes, restricted cpusets, CPU-only hosts."""
from __future__ import annotations

import json
import os

from launcher_fakes import FIXTURES, eight_numa_nodes, make_dev, make_sys, recorded_npu_smi

from launcher import devices, numa
from launcher.devices import format_id_list as fmt


def atlas_devices(root, npu_smi=recorded_npu_smi, env=None):
    make_dev(root)
    return devices.probe(root / "dev", root, env or {}, npu_smi)


def test_eight_nodes_from_npu_smi_topo(tmp_path):
    sys_root = make_sys(tmp_path, eight_numa_nodes(), cpuset_v2="0-191")
    d = atlas_devices(tmp_path)
    ranks, info = numa.plan(8, "auto", d, sys_root, have_numactl=True, probe=lambda options: None)
    # NPU pairs share a node (topo CPU Affinity 0-23, 48-71, 96-119, 144-167): each gets half of it
    assert [(r.device, r.numa_node, fmt(r.cpus)) for r in ranks] == [
        (0, 0, "0-11"), (1, 0, "12-23"), (2, 2, "48-59"), (3, 2, "60-71"),
        (4, 4, "96-107"), (5, 4, "108-119"), (6, 6, "144-155"), (7, 6, "156-167")]
    assert ranks[0].numactl_args(numa.numa_nodes(sys_root)) == ["--physcpubind=0-11", "--membind=0"]
    assert info["method"] == "numactl" and info["allowed_from"] == "/sys/fs/cgroup/cpuset.cpus.effective"
    env = numa.worker_env(ranks, numa.numa_nodes(sys_root))
    assert env["AF_BIND_MODE"] == "numactl" and env["AF_CPU_BIND_3"] == "60-71" and env["AF_MEM_BIND_3"] == "2"
    assert env["AF_NUMACTL_3"] == "--physcpubind=60-71 --membind=2"


def test_whole_node_uses_cpunodebind(tmp_path):
    sys_root = make_sys(tmp_path, eight_numa_nodes(), cpuset_v2="0-191")
    d = atlas_devices(tmp_path, env={"ASCEND_VISIBLE_DEVICES": "0,2"})
    ranks, _ = numa.plan(2, "numactl", d, sys_root, have_numactl=True, probe=lambda options: None)
    nodes = numa.numa_nodes(sys_root)
    assert ranks[1].device == 2 and ranks[1].numactl_args(nodes) == ["--cpunodebind=2", "--membind=2"]


# PCI numa_node per bus on a two-node host; NPU i sits on bus BUS_25[i] (the npu-smi 25.2.0 recording)
PCI = {f"0000:{b}:00.0": n for b, n in zip(["01", "02", "41", "42", "81", "82", "c1", "c2"], [0, 0, 0, 0, 1, 1, 1, 1])}


def test_pci_numa_node_of_the_bus_npu_smi_names(tmp_path):
    sys_root = make_sys(tmp_path, {0: "0-63", 1: "64-127"}, pci=PCI)
    info = (FIXTURES / "npu-smi" / "info-procs-25.2.0-910b2.txt").read_text()
    d = atlas_devices(tmp_path, npu_smi=lambda args: info if args == ["info"] else None)
    ranks, _ = numa.plan(8, "affinity", d, sys_root, getaffinity=lambda pid: set(range(128)))
    # buses C1, 01, C2, 02, 81, 41, 82, 42: not the bus order [0, 0, 0, 0, 1, 1, 1, 1]
    assert [r.numa_node for r in ranks] == [1, 0, 1, 0, 1, 0, 1, 0]
    assert fmt(ranks[0].cpus) == "64-79" and fmt(ranks[1].cpus) == "0-15"
    assert all(r.reason == "PCI numa_node in sysfs" for r in ranks)


def test_without_npu_smi_no_node_is_guessed_from_bus_order(tmp_path):
    sys_root = make_sys(tmp_path, {0: "0-63", 1: "64-127"}, pci=PCI)
    d = atlas_devices(tmp_path, npu_smi=None)
    ranks, info = numa.plan(8, "affinity", d, sys_root, getaffinity=lambda pid: set(range(128)))
    assert info["allowed_from"] == "sched_getaffinity" and info["method"] == "affinity"
    assert [fmt(r.cpus) for r in ranks] == [f"{16 * i}-{16 * i + 15}" for i in range(8)]
    assert all("PCI bus order is not NPU order" in r.reason for r in ranks)


def test_restricted_cpuset_v1_is_intersected(tmp_path):
    sys_root = make_sys(tmp_path, eight_numa_nodes(), cpuset_v1="0-5,48-53")
    d = atlas_devices(tmp_path, env={"ASCEND_VISIBLE_DEVICES": "0-3"})
    ranks, info = numa.plan(4, "affinity", d, sys_root)
    assert info["allowed_cpus"] == "0-5,48-53"
    assert [fmt(r.cpus) for r in ranks] == ["0-2", "3-5", "48-50", "51-53"]
    assert all(set(r.cpus) <= set(range(0, 6)) | set(range(48, 54)) for r in ranks)


def test_node_without_allowed_cpus_falls_back_to_even_split(tmp_path):
    sys_root = make_sys(tmp_path, eight_numa_nodes(), cpuset_v2="96-103")
    d = atlas_devices(tmp_path, env={"ASCEND_VISIBLE_DEVICES": "0,1"})
    ranks, _ = numa.plan(2, "affinity", d, sys_root)
    assert [fmt(r.cpus) for r in ranks] == ["96-99", "100-103"] and ranks[0].numa_node == 4


def test_cpu_only_even_split_and_numactl_missing(tmp_path):
    sys_root = make_sys(tmp_path, {0: "0-7", 1: "8-15"}, cpuset_v2="0-15")
    no_npu = devices.Devices()
    ranks, info = numa.plan(4, "numactl", no_npu, sys_root, have_numactl=False)
    assert info["method"] == "affinity" and "numactl is not installed" in info["note"]
    assert [(fmt(r.cpus), r.numa_node) for r in ranks] == [("0-3", 0), ("4-7", 0), ("8-11", 1), ("12-15", 1)]


def test_off_binds_nothing(tmp_path):
    sys_root = make_sys(tmp_path, {0: "0-7"}, cpuset_v2="0-7")
    ranks, _ = numa.plan(2, "off", devices.Devices(), sys_root)
    assert all(not r.cpus for r in ranks)
    assert numa.worker_env(ranks, {}) == {"AF_BIND_MODE": "off"}


def fake_numactl(bin_dir, monkeypatch, stderr: str, code: int):
    """A ``numactl`` first on PATH that fails like the real one under Docker's default seccomp profile:
    libnuma's numa_error() is perror("set_mempolicy") and numactl exits 1 (numactl's libnuma.c, setpol)."""
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "numactl"
    exe.write_text(f"#!/bin/sh\necho \"$@\" >> {bin_dir}/calls\nprintf '%s\\n' '{stderr}' >&2\nexit {code}\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return bin_dir / "calls"


SECCOMP_BLOCKED = "set_mempolicy: Operation not permitted"


def test_membind_blocked_by_seccomp_falls_back_to_cpu_affinity(tmp_path, monkeypatch):
    calls = fake_numactl(tmp_path / "bin", monkeypatch, SECCOMP_BLOCKED, 1)
    sys_root = make_sys(tmp_path, eight_numa_nodes(), cpuset_v2="0-191")
    ranks, info = numa.plan(8, "auto", atlas_devices(tmp_path), sys_root, have_numactl=True)
    assert calls.read_text().split() == ["--membind=0", "--cpunodebind=0", "true"]  # once, the exact binding
    assert info["method"] == "affinity" and {r.method for r in ranks} == {"affinity"}
    assert SECCOMP_BLOCKED in info["fallback"] and "--cap-add SYS_NICE" in info["fallback"]
    env = numa.worker_env(ranks, numa.numa_nodes(sys_root))
    assert env["AF_BIND_MODE"] == "affinity" and env["AF_CPU_BIND_3"] == "60-71"
    assert not [k for k in env if k.startswith("AF_NUMACTL_")]


def test_membind_failing_otherwise_falls_back_without_blaming_seccomp(tmp_path, monkeypatch):
    fake_numactl(tmp_path / "bin", monkeypatch, "set_mempolicy: Invalid argument", 1)
    sys_root = make_sys(tmp_path, eight_numa_nodes(), cpuset_v2="0-191")
    ranks, info = numa.plan(8, "numactl", atlas_devices(tmp_path), sys_root, have_numactl=True)
    assert info["method"] == "affinity" and "Invalid argument" in info["fallback"]
    assert "SYS_NICE" not in info["fallback"] and "cpuset.mems" in info["fallback"]


def test_working_membind_keeps_numactl(tmp_path, monkeypatch):
    calls = fake_numactl(tmp_path / "bin", monkeypatch, "", 0)
    sys_root = make_sys(tmp_path, eight_numa_nodes(), cpuset_v2="0-191")
    ranks, info = numa.plan(2, "numactl", atlas_devices(tmp_path, env={"ASCEND_VISIBLE_DEVICES": "4,5"}),
                            sys_root, have_numactl=True)
    assert calls.read_text().split() == ["--membind=4", "--cpunodebind=4", "true"]
    assert info["method"] == "numactl" and "fallback" not in info and {r.method for r in ranks} == {"numactl"}


def test_plan_says_why_memory_binding_is_off(atlas, tmp_path, monkeypatch, capsys):
    import launcher.__main__ as lm

    fake_numactl(tmp_path / "bin", monkeypatch, SECCOMP_BLOCKED, 1)
    host = lm.Host(env={"OUTPUT_DIR": str(tmp_path / "o"), "MODEL_DIR": str(tmp_path), "DATA": str(tmp_path)},
                   dev_dir=atlas / "dev", root=atlas, sys_root=atlas / "sys", npu_smi=recorded_npu_smi,
                   have_numactl=True, identities={"node-a"})
    assert lm.main(["plan", "--recipe", "qwen2.5-7b-full"], host) == 0
    out = capsys.readouterr().out
    assert "binding (affinity," in out and "docker run --cap-add SYS_NICE turns memory binding on" in out
    plan = json.JSONDecoder().raw_decode(out[out.index("\n{") + 1:])[0]
    assert SECCOMP_BLOCKED in plan["binding"]["fallback"]
    assert plan["worker_env"]["AF_BIND_MODE"] == "affinity"


def test_msrun_scheduler_process_is_never_bound(monkeypatch):
    """msrun starts its scheduler with MS_ROLE=MS_SCHED and no DEVICE_ID: it must not take rank 0's binding."""
    from finetune import affinity

    bound = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: bound.append(cpus))
    monkeypatch.setattr(os, "execve", lambda *a: bound.append(a))
    plan_env = {"AF_BIND_MODE": "numactl", "AF_CPU_BIND_0": "0-11", "AF_NUMACTL_0": "--cpunodebind=0 --membind=0"}
    assert affinity.apply_binding({**plan_env, "MS_ROLE": "MS_SCHED"}, argv=["w.py"]).startswith("not bound")
    assert affinity.apply_binding({**plan_env, "AF_BIND_MODE": "affinity", "MS_ROLE": "MS_SCHED"}) \
        .startswith("not bound")
    assert bound == []
    assert affinity.apply_binding({**plan_env, "AF_BIND_MODE": "affinity", "MS_ROLE": "MS_WORKER",
                                   "DEVICE_ID": "0"}) == "CPU affinity 0-11" and bound == [set(range(12))]
