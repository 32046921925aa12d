"""The versions the self-test reports first: driver, firmware, CANN, MindSpore, and whether the
MindSpore/CANN pair is one this project documents (MindSpore 2.10 with a CANN line of ``jobspec.cann``'s
table). Pure Python: files and ``npu-smi`` only, no mindspore import.

Driver and CANN are read as preflight reads them (``jobspec.cann``); the firmware from
``/usr/local/Ascend/firmware/version.info`` (``Version=``; on hosts without it, ``npu-smi info -t board -i 0``'s
"Firmware Version").
"""
from __future__ import annotations

import re
import subprocess
from importlib import metadata
from pathlib import Path

from jobspec import cann

MINDSPORE = "2.10"  # the MindSpore line (pyproject.toml's pin) the CANN table is for


def _npu_smi_firmware() -> str | None:
    try:
        out = subprocess.run(["npu-smi", "info", "-t", "board", "-i", "0"], capture_output=True, text=True,
                             timeout=15).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"Firmware Version\s*:\s*(\S+)", out)
    return m.group(1) if m else None


def probe(root: Path = Path("/"), npu: bool = True) -> dict[str, str | bool | None]:
    """Every version (None where unknown) and ``supported_pair``: the MindSpore/CANN pair is documented."""
    try:
        mindspore = metadata.version("mindspore")
    except metadata.PackageNotFoundError:
        mindspore = None
    firmware = cann.info_field(root / "usr/local/Ascend/firmware/version.info", "Version")
    out: dict[str, str | bool | None] = {
        "driver": cann.driver_version(root),
        "firmware": firmware or (_npu_smi_firmware() if npu else None),
        "cann": cann.image_cann(root),
        "mindspore": mindspore,
    }
    out["supported_pair"] = (cann.major_minor(mindspore) == cann.major_minor(MINDSPORE)
                             and cann.release_of(out["cann"]) is not None)  # type: ignore[arg-type]
    out["documented_pairs"] = f"MindSpore {MINDSPORE} + CANN " + " / ".join(r.line for r in cann.RELEASES)
    return out


def lines(v: dict) -> list[str]:
    pair = "yes" if v["supported_pair"] else f"NO (documented: {v['documented_pairs']})"
    return [f"driver {v['driver'] or 'unknown'}, firmware {v['firmware'] or 'unknown'}, CANN {v['cann'] or 'unknown'}, "
            f"MindSpore {v['mindspore'] or 'unknown'}; MindSpore/CANN pair documented as supported: {pair}"]
