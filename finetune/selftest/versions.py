"""The versions the self-test reports first: driver, firmware, CANN, MindSpore, and whether the
MindSpore/CANN pair is the one this project documents (the Dockerfile's BASE_IMAGE comment:
MindSpore 2.10 with CANN 9.1). Pure Python: files and ``npu-smi`` only, no mindspore import.

Where they are read (as ``launcher.preflight.check_versions`` reads driver and CANN):
``/usr/local/Ascend/driver/version.info`` (``Version=``), ``/usr/local/Ascend/firmware/version.info``
(``Version=``; on hosts without it, ``npu-smi info -t board -i 0``'s "Firmware Version"),
``/usr/local/Ascend/ascend-toolkit/latest/*/ascend_toolkit_install.info`` (``version=``).
"""
from __future__ import annotations

import glob
import re
import subprocess
from importlib import metadata
from pathlib import Path

SUPPORTED = {"2.10": "9.1"}  # MindSpore major.minor -> CANN major.minor (Dockerfile BASE_IMAGE comment)


def _field(path: Path, key: str) -> str | None:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    return next((ln.split("=", 1)[1].strip() for ln in lines if ln.startswith(key + "=")), None)


def _npu_smi_firmware() -> str | None:
    try:
        out = subprocess.run(["npu-smi", "info", "-t", "board", "-i", "0"], capture_output=True, text=True,
                             timeout=15).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"Firmware Version\s*:\s*(\S+)", out)
    return m.group(1) if m else None


def _minor(version: str | None) -> str | None:
    m = re.match(r"(\d+\.\d+)", version or "")
    return m.group(1) if m else None


def probe(root: Path = Path("/"), npu: bool = True) -> dict[str, str | bool | None]:
    """Every version (None where unknown) and ``supported_pair``: the MindSpore/CANN pair is documented."""
    ascend = root / "usr/local/Ascend"
    infos = sorted(glob.glob(str(ascend / "ascend-toolkit/latest/*/ascend_toolkit_install.info")))
    try:
        mindspore = metadata.version("mindspore")
    except metadata.PackageNotFoundError:
        mindspore = None
    out: dict[str, str | bool | None] = {
        "driver": _field(ascend / "driver/version.info", "Version"),
        "firmware": _field(ascend / "firmware/version.info", "Version") or (_npu_smi_firmware() if npu else None),
        "cann": _field(Path(infos[0]), "version") if infos else None,
        "mindspore": mindspore,
    }
    want = SUPPORTED.get(_minor(mindspore) or "")
    out["supported_pair"] = want is not None and _minor(out["cann"]) == want  # type: ignore[arg-type]
    out["documented_pairs"] = ", ".join(f"MindSpore {m} + CANN {c}" for m, c in SUPPORTED.items())
    return out


def lines(v: dict) -> list[str]:
    pair = "yes" if v["supported_pair"] else f"NO (documented: {v['documented_pairs']})"
    return [f"driver {v['driver'] or 'unknown'}, firmware {v['firmware'] or 'unknown'}, CANN {v['cann'] or 'unknown'}, "
            f"MindSpore {v['mindspore'] or 'unknown'}; MindSpore/CANN pair documented as supported: {pair}"]
