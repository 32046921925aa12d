"""NUMA binding plans on fake sysfs trees: 2 and 8 NUMA nodes, restricted cpusets, CPU-only hosts."""
from __future__ import annotations

from launcher_fakes import FIXTURES, eight_numa_nodes, make_dev, make_sys, recorded_npu_smi

from launcher import devices, numa
from launcher.devices import format_id_list as fmt


def atlas_devices(root, npu_smi=recorded_npu_smi, env=None):
    make_dev(root)
    return devices.probe(root / "dev", root, env or {}, npu_smi)


def test_eight_nodes_from_npu_smi_topo(tmp_path):
    sys_root = make_sys(tmp_path, eight_numa_nodes(), cpuset_v2="0-191")
    d = atlas_devices(tmp_path)
    ranks, info = numa.plan(8, "auto", d, sys_root, have_numactl=True)
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
    ranks, _ = numa.plan(2, "numactl", d, sys_root, have_numactl=True)
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
