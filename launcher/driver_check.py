"""Preflight's driver row: the host's Ascend HDK driver against the image's CANN (``jobspec.cann``'s table).

A driver older than the image's CANN needs fails with the exact rebuild command for a CANN it runs (or the
driver upgrade, when no CANN in the table runs on it); a CANN outside the table is a warning.
"""
from __future__ import annotations

from pathlib import Path

from jobspec import cann
from launcher.npu_smi import NpuSmi, driver_version, run_npu_smi

Row = tuple[str, str, str, str]  # (name, ok | warn | fail, detail, fix): preflight.Check's fields
MOUNT = f"-v /{cann.DRIVER_INFO}:/{cann.DRIVER_INFO}:ro"


def host_driver(root: Path, npu_smi: NpuSmi | None) -> str | None:
    """The mounted ``version.info``'s version, else ``npu-smi info``'s header (npu-smi runs only then)."""
    found = cann.driver_version(root)
    if found is None and npu_smi is not None and (text := npu_smi(["info"])):
        found = driver_version(text)
    return found


def driver_rows(root: Path = Path("/"), npu_smi: NpuSmi | None = run_npu_smi) -> list[Row]:
    """The driver and CANN rows (an NPU host only)."""
    driver, image = host_driver(root, npu_smi), cann.image_cann(root)
    missing = []
    if driver is None:
        missing.append(("driver", "fail", f"driver version unknown: /{cann.DRIVER_INFO} not mounted and npu-smi "
                        "gave none", f"docker run ... {MOUNT}"))
    if image is None:
        missing.append(("CANN", "fail", f"no CANN version recorded in this image (/{cann.RECORD}) and no "
                        "ascend_toolkit_install.info", f"use the image built on a CANN base: "
                        f"{cann.rebuild_command(cann.DEFAULT)}"))
    if driver is None or image is None:
        return missing
    release = cann.release_of(image)
    if release is None:
        return [("driver/CANN", "warn", f"driver {driver}, CANN {image}: CANN {image} is not in jobspec/cann.py's "
                 "table, so their match is unchecked", f"or use a listed CANN: {cann.rebuild_command(cann.DEFAULT)}")]
    if cann.runs_on(release, driver):
        return [("driver/CANN", "ok", f"driver {driver} runs the image's CANN {image} "
                 f"(needs {release.min_driver}+)", "")]
    fit = cann.best_for(driver)
    fix = (f"rebuild the image on CANN {fit.line}, which driver {driver} runs: {cann.rebuild_command(fit)}"
           if fit else f"upgrade the driver (Ascend HDK npu-driver) to {release.min_driver} or newer")
    return [("driver/CANN", "fail", f"driver {driver} is older than the image's CANN {image} needs "
             f"(Ascend HDK {release.min_driver}+, {release.source})", fix)]
