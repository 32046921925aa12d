"""Does the installed MindSpore's native code match this machine? Read from an ELF header, no import.

PyPI's ``mindspore==2.10.0`` wheel is tagged ``py3-none-any`` but holds x86-64 libraries, so pip
installs it on aarch64 (the Atlas 800T A2's Kunpeng CPUs) and ``import mindspore`` then fails in
the dynamic loader. The aarch64 wheel comes from MindSpore's release repository. Used by the
launcher's preflight, the worker's start and the image build (``python -m jobspec.native``).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

# ELF e_machine values (System V ABI, elf.h EM_*) -> the name platform.machine() uses.
ELF_MACHINES = {3: "i386", 20: "ppc", 21: "ppc64", 22: "s390x", 40: "arm", 62: "x86_64", 183: "aarch64",
                243: "riscv64"}
MACHINE_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}
# The library to read first: the core every MindSpore import loads; the extension module as fallback.
PROBES = ("lib/libmindspore_core.so", "_c_expression*.so")
# The release repository's layout, as the links on mindspore.cn/install follow it (2.0 to 2.7 seen).
WHEEL_URL = ("https://ms-release.obs.cn-north-4.myhuaweicloud.com/{v}/MindSpore/unified/{m}/"
             "mindspore-{v}-cp{py}-cp{py}-linux_{m}.whl")


@dataclass
class NativeCheck:
    status: str  # ok | warn | fail
    detail: str
    fix: str = ""


def elf_machine(path: Path) -> str | None:
    """The architecture an ELF file is built for (its e_machine field), None when not ELF."""
    with open(path, "rb") as f:
        head = f.read(20)
    if len(head) < 20 or head[:4] != b"\x7fELF":
        return None
    code = int.from_bytes(head[18:20], "little" if head[5] == 1 else "big")  # EI_DATA: 1 = little-endian
    return ELF_MACHINES.get(code, f"ELF machine {code}")


def host_machine() -> str:
    m = platform.machine().lower()
    return MACHINE_ALIASES.get(m, m)


def mindspore_package() -> Path | None:
    """The installed ``mindspore`` package directory, found without importing it."""
    spec = importlib.util.find_spec("mindspore")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def _version() -> str:
    try:
        return importlib.metadata.version("mindspore")
    except importlib.metadata.PackageNotFoundError:
        return "2.10.0"


def wheel_url(version: str, machine: str) -> str:
    py = f"{sys.version_info.major}{sys.version_info.minor}"
    return WHEEL_URL.format(v=version, m=machine, py=py)


def check_mindspore(package: Path | None = None, machine: str | None = None,
                    version: str | None = None) -> NativeCheck:
    """Compare the machine of MindSpore's native library with this host's; a fail names the fix."""
    package = package or mindspore_package()
    machine = machine or host_machine()
    version = version or _version()
    if package is None:
        return NativeCheck("fail", "mindspore is not installed",
                           "make setup (aarch64: make setup MINDSPORE_WHEEL=<linux_aarch64 wheel>)")
    lib = next((p for pattern in PROBES for p in sorted(package.glob(pattern))), None)
    if lib is None:
        return NativeCheck("warn", f"{package}: no native library found to check ({', '.join(PROBES)})")
    built_for = elf_machine(lib)
    if built_for == machine:
        return NativeCheck("ok", f"mindspore {version}: {lib.name} is {built_for}, as this machine")
    url = wheel_url(version, machine)
    return NativeCheck(
        "fail", f"mindspore {version} at {package} holds {built_for or 'non-ELF'} native code ({lib.name}) but this "
                f"machine is {machine}: `import mindspore` fails (PyPI's wheel is tagged py3-none-any but is x86-64)",
        f"install the {machine} wheel: python -m pip install --force-reinstall --no-deps {url} ; "
        f"make setup MINDSPORE_WHEEL={url} ; image: --build-arg MINDSPORE_WHEEL={url} "
        f"(MindSpore's release repository; see mindspore.cn/install)")


def mindspore_mismatch() -> str | None:
    """For a worker's start: None when MindSpore can load here, else the problem and its fix, one message."""
    c = check_mindspore()
    return None if c.status != "fail" else f"{c.detail}\n  fix: {c.fix}"


def main() -> int:
    """``python -m jobspec.native``: print the check; exit 1 when MindSpore cannot load on this machine."""
    c = check_mindspore()
    print(f"native {c.status}: {c.detail}" + (f"\n  fix: {c.fix}" if c.fix else ""),
          file=sys.stderr if c.status == "fail" else sys.stdout)
    return 1 if c.status == "fail" else 0


if __name__ == "__main__":
    sys.exit(main())
