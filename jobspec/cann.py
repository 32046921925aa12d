"""The CANN releases the image can be built on, each with the oldest Ascend HDK driver that runs it: the one
table read by the image build (Dockerfile, ``python -m jobspec.cann``), preflight (``launcher/driver_check.py``),
the self-test's version line and docs (docs/container.md).

Sources, per row (``CannRelease.source``). MindSpore pins each release to one CANN release (MindFormers'
version-match table: MindSpore 2.7.2 + CANN 8.5.0 + HDK 25.5.0, 2.9.0 + 9.0.0 + 26.0.RC1); no table searched for
this project held a MindSpore 2.10 row, so the image's default is the newest 8.x, which runs on every 25.x driver,
and 9.x is a build argument away (``make image BASE_IMAGE=...``).

Where the versions are read: the image's CANN from the file the build writes (:data:`RECORD`), else CANN's own
``ascend_toolkit_install.info`` (``version=``); the host's driver from ``/usr/local/Ascend/driver/version.info``
(``Version=``), which the container mounts, else ``npu-smi info``'s ``Version:`` header.
"""
from __future__ import annotations

import glob
import re
import sys
from dataclasses import dataclass
from pathlib import Path

RECORD = "etc/ascend-finetune/cann-version"  # under the image's root; written by the build
TOOLKIT_INFOS = ("usr/local/Ascend/ascend-toolkit/latest/*/ascend_toolkit_install.info",
                 "usr/local/Ascend/cann/*/ascend_toolkit_install.info",  # the layout from CANN 8.5 on
                 "usr/local/Ascend/cann-*/*/ascend_toolkit_install.info")
DRIVER_INFO = "usr/local/Ascend/driver/version.info"
_NOTES_850 = "CANN 8.5.0 release notes, version mapping (hiascend.com canncommercial/850/releasenote)"
_NOTES_910 = "CANN 9.1.0 release notes, CANN/Ascend HDK compatibility (gitcode.com/cann/release-management 9.1.0)"


@dataclass(frozen=True)
class CannRelease:
    line: str  # major.minor: every x.y.z of it
    min_driver: str  # the oldest Ascend HDK line (major.minor) it runs on
    base_image: str  # a published 910B base image with Python 3.11 ("" when none is known)
    source: str


RELEASES = (
    CannRelease("8.5", "25.0", "ascendai/cann:8.5.0-910b-ubuntu22.04-py3.11",
                f"{_NOTES_850}: HDK 25.0.X-25.5.X; {_NOTES_910}: 8.5.2 on 25.0.X-26.1.0"),
    CannRelease("9.0", "25.0", "", f"{_NOTES_910}: 9.0.X on 25.0.X-26.1.0"),
    CannRelease("9.1", "25.2", "ascendai/cann:9.1.0-beta.3-910b-ubuntu22.04-py3.11",
                f"{_NOTES_910}: 9.1.X on 25.2.X-26.1.0, not on 25.0.X"),
)
DEFAULT = RELEASES[0]  # the Dockerfile's BASE_IMAGE (tests/test_image.py holds them equal)


def major_minor(version: str | None) -> tuple[int, int] | None:
    """(25, 2) from ``25.2.0``, ``25.2.RC1``, ``25.2.rc1``; None when it does not start with two numbers."""
    m = re.match(r"\s*(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def release_of(cann: str | None) -> CannRelease | None:
    """The table row of a CANN version (``8.5.0`` -> the 8.5 row); None when not in the table."""
    mm = major_minor(cann)
    return next((r for r in RELEASES if major_minor(r.line) == mm), None)


def runs_on(release: CannRelease, driver: str) -> bool:
    """Does the host driver (``version.info``'s ``Version=``) run this CANN line?"""
    have, need = major_minor(driver), major_minor(release.min_driver)
    return have is not None and need is not None and have >= need


def best_for(driver: str) -> CannRelease | None:
    """The newest table row with a published image that this driver runs; None when none does."""
    fits = [r for r in RELEASES if r.base_image and runs_on(r, driver)]
    return max(fits, key=lambda r: major_minor(r.line) or (0, 0), default=None)


def rebuild_command(release: CannRelease) -> str:
    return (f"make image BASE_IMAGE={release.base_image} (or: docker build --build-arg "
            f"BASE_IMAGE={release.base_image} -t ascend-finetune .)")


def info_field(path: Path, key: str) -> str | None:
    """``key=value`` of an Ascend info file (``version.info``, ``*_install.info``), or None."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    return next((ln.split("=", 1)[1].strip() for ln in lines if ln.startswith(key + "=")), None)


def toolkit_version(root: Path = Path("/")) -> str | None:
    """CANN's own record of the installed toolkit version, or None."""
    infos = sorted(p for pattern in TOOLKIT_INFOS for p in glob.glob(str(root / pattern)))
    return next((v for v in (info_field(Path(p), "version") for p in infos) if v), None)


def image_cann(root: Path = Path("/")) -> str | None:
    """The image's CANN version: the build's record, else the toolkit's install info."""
    try:
        return (root / RECORD).read_text().strip() or None
    except OSError:
        return toolkit_version(root)


def driver_version(root: Path = Path("/")) -> str | None:
    """The host driver's version from the mounted ``version.info``, or None."""
    return info_field(root / DRIVER_INFO, "Version")


def record(root: Path = Path("/"), base_image: str = "") -> str:
    """At image build: write the CANN version (toolkit info, else the base image's tag) to :data:`RECORD`."""
    tag = re.search(r":(\d+\.\d+\.\w+)", base_image)
    version = toolkit_version(root) or (tag.group(1) if tag else "")
    if not version:
        raise SystemExit(f"no CANN found in the base image {base_image or '(BASE_IMAGE)'}: no "
                         f"{' or '.join(TOOLKIT_INFOS)}; use a CANN image, e.g. BASE_IMAGE={DEFAULT.base_image}")
    (root / RECORD).parent.mkdir(parents=True, exist_ok=True)
    (root / RECORD).write_text(version + "\n")
    row = release_of(version)
    return (f"CANN {version}: runs on Ascend HDK driver {row.min_driver} or newer ({row.source})" if row else
            f"CANN {version}: not in jobspec/cann.py's table; preflight cannot compare it with the host driver")


def main(argv: list[str]) -> int:
    """``python -m jobspec.cann record BASE_IMAGE`` (the image build) or ``python -m jobspec.cann`` (the table)."""
    if argv[:1] == ["record"]:
        print(record(Path("/"), argv[1] if len(argv) > 1 else ""))
        return 0
    print("| CANN | oldest Ascend HDK driver | base image | source |\n|---|---|---|---|")
    for r in RELEASES:
        print(f"| {r.line}.x | {r.min_driver} | {r.base_image or '-'} | {r.source} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
