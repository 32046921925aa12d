"""Fake hosts for launcher tests: /dev and /sys trees, driver mounts, recorded npu-smi outputs."""
from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
NPU_SMI = {("info",): "info.txt", ("info", "-m"): "info-m.txt", ("info", "-t", "topo"): "info-t-topo.txt"}


def recorded_npu_smi(args: list[str]) -> str | None:
    """npu-smi as recorded on an Atlas 800T A2 (8 x 910B3)."""
    name = NPU_SMI.get(tuple(args))
    return (FIXTURES / "npu-smi" / name).read_text() if name else None


def npu_smi_with_info(info_file: str):
    """recorded_npu_smi, but ``npu-smi info`` answers with another recorded file (see fixtures/npu-smi)."""
    def run(args: list[str]) -> str | None:
        return (FIXTURES / "npu-smi" / info_file).read_text() if args == ["info"] else recorded_npu_smi(args)
    return run


def make_dev(root: Path, npus: int = 8, mgmt: tuple[str, ...] = ("davinci_manager", "devmm_svm", "hisi_hdc")) -> Path:
    dev = root / "dev"
    dev.mkdir(parents=True, exist_ok=True)
    for i in range(npus):
        (dev / f"davinci{i}").write_text("")
    for m in mgmt:
        (dev / m).write_text("")
    return dev


def loadable_library() -> Path:
    """A shared object any Python here can load (stands in for the driver's libraries)."""
    import _ctypes

    return Path(_ctypes.__file__)


def make_driver(root: Path, driver: bool = True, dcmi: bool = True, npu_smi: bool = True, cann: bool = True,
                lib64: bool = True, install_info: bool = True) -> None:
    """The host pieces of the canonical docker run mounts (launcher/mounts.py), each optional."""
    if driver:
        d = root / "usr/local/Ascend/driver"
        d.mkdir(parents=True, exist_ok=True)
        (d / "version.info").write_text("Version=25.2.0\nascendhal_version=7.35.23\n")  # an 800T A2 with CANN 8.5
    if lib64:
        for lib in ("common/libc_sec.so", "driver/libascend_hal.so"):
            p = root / "usr/local/Ascend/driver/lib64" / lib
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(loadable_library().read_bytes())
    if install_info:
        (root / "etc").mkdir(parents=True, exist_ok=True)
        (root / "etc/ascend_install.info").write_text("Driver_Install_Path_Param=/usr/local/Ascend\n")
    if dcmi:
        (root / "usr/local/dcmi").mkdir(parents=True, exist_ok=True)
    if npu_smi:
        (root / "usr/local/bin").mkdir(parents=True, exist_ok=True)
        (root / "usr/local/bin/npu-smi").write_text("")
    if cann:
        c = root / "usr/local/Ascend/ascend-toolkit/latest/aarch64-linux"
        c.mkdir(parents=True, exist_ok=True)
        (c / "ascend_toolkit_install.info").write_text("package_name=Ascend-cann-toolkit\nversion=8.5.0\n")


def make_sys(root: Path, nodes: dict[int, str], cpuset_v2: str | None = None, cpuset_v1: str | None = None,
             pci: dict[str, int] | None = None) -> Path:
    """A /sys tree: NUMA nodes with cpulists, an optional cgroup cpuset, Huawei PCI devices."""
    s = root / "sys"
    for n, cpus in nodes.items():
        d = s / f"devices/system/node/node{n}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpulist").write_text(cpus + "\n")
    (s / "fs/cgroup").mkdir(parents=True, exist_ok=True)
    if cpuset_v2 is not None:
        (s / "fs/cgroup/cpuset.cpus.effective").write_text(cpuset_v2 + "\n")
    if cpuset_v1 is not None:
        (s / "fs/cgroup/cpuset").mkdir(parents=True, exist_ok=True)
        (s / "fs/cgroup/cpuset/cpuset.cpus").write_text(cpuset_v1 + "\n")
    for addr, node in (pci or {}).items():
        d = s / "bus/pci/devices" / addr
        d.mkdir(parents=True, exist_ok=True)
        (d / "vendor").write_text("0x19e5\n")
        (d / "class").write_text("0x120000\n")
        (d / "numa_node").write_text(f"{node}\n")
    return s


def eight_numa_nodes() -> dict[int, str]:
    """Atlas 800T A2: 4 x Kunpeng 920 (48 cores each), 2 NUMA nodes per socket, 192 CPUs."""
    return {n: f"{24 * n}-{24 * n + 23}" for n in range(8)}


