"""What an NPU container needs from the host, and preflight rows naming a missing piece by what failed.

The canonical ``docker run`` set (docs/running.md "One Atlas 800T A2"): the ``/dev/davinciN`` devices, the
management devices ``davinci_manager``, ``devmm_svm`` and ``hisi_hdc``, and read-only mounts of
``/usr/local/dcmi``, ``/usr/local/bin/npu-smi``, ``/usr/local/Ascend/driver/lib64``,
``/usr/local/Ascend/driver/version.info`` and ``/etc/ascend_install.info``. Without the driver's
``lib64`` the runtime finds no ``libc_sec.so``/``libascend_hal.so``; an ``npu-smi`` that answers
``dcmi module initialize failed. ret is -8005`` or ``... because the device is used. ret is -8020``
usually means another container holds the NPUs (vllm-ascend#2698, cann-container-image#46).
"""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

MGMT_DEVICES = ("davinci_manager", "devmm_svm", "hisi_hdc")
# path -> what is missing without it
DRIVER_MOUNTS = {
    "/usr/local/Ascend/driver/lib64": "the host driver's libraries (libc_sec.so, libascend_hal.so)",
    "/usr/local/Ascend/driver/version.info": "the driver version CANN and preflight read",
    "/usr/local/dcmi": "the device management library npu-smi loads",
    "/usr/local/bin/npu-smi": "npu-smi: HBM size, health, NPU holders and NUMA affinity",
    "/etc/ascend_install.info": "where the driver is installed, read by the CANN runtime",
}
DRIVER_LIBRARIES = ("usr/local/Ascend/driver/lib64/common/libc_sec.so",
                    "usr/local/Ascend/driver/lib64/driver/libascend_hal.so")
DCMI_ERRORS = {
    -8005: "dcmi could not initialise: usually another container holds these NPUs",
    -8020: "the device is used: another container holds these NPUs",
}
LibraryLoader = Callable[[list[Path]], "str | None"]


def load_libraries(paths: list[Path], timeout_s: float = 30.0) -> str | None:
    """Load ``paths`` in order in a fresh Python (the launcher never maps driver code): None, or the error."""
    code = "import ctypes, sys\nfor p in sys.argv[1:]:\n    ctypes.CDLL(p, mode=ctypes.RTLD_GLOBAL)"
    try:
        r = subprocess.run([sys.executable, "-c", code, *map(str, paths)], capture_output=True, text=True,
                           timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}"
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]


def _mount(path: str) -> str:
    return f"docker run -v {path}:{path}:ro (Kubernetes: a read-only hostPath volume)"


def mount_problems(missing_mgmt: list[str], missing_mounts: list[str], dcmi_error: int | None, root: Path,
                   load: LibraryLoader = load_libraries) -> list[tuple[str, str]]:
    """(what failed, fix) for each absent device node or mount, a driver library that does not load, and
    npu-smi's 'another container holds the device' codes."""
    out = [(f"device node /dev/{m} is absent", f"docker run --device=/dev/{m}") for m in missing_mgmt]
    out += [(f"{m} is absent ({DRIVER_MOUNTS[m]})", _mount(m)) for m in missing_mounts]
    lib64 = "/usr/local/Ascend/driver/lib64"
    if lib64 not in missing_mounts:
        libs = [root / p for p in DRIVER_LIBRARIES]
        absent = [p for p in libs if not p.is_file()]
        if absent:
            out.append((f"driver library {absent[0]} is absent: {lib64} is not the host driver's", _mount(lib64)))
        elif (why := load(libs)) is not None:
            out.append((f"a driver library does not load: {why}",
                        f"{_mount(lib64)}, the host's own driver (the one its kernel module came with)"))
    if dcmi_error is not None:
        meaning = DCMI_ERRORS.get(dcmi_error, "npu-smi could not open the NPUs")
        out.append((f"npu-smi info failed with {dcmi_error}: {meaning}",
                    "stop the other container or process holding the NPUs (on the host: `npu-smi info` lists "
                    "them; docker ps), or give this container other NPUs (--device=/dev/davinciN)"))
    return out
