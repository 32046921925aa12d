"""Issue 30 item 5: preflight compares the host's driver with the image's CANN (jobspec/cann.py's table) and
refuses a driver too old for it, naming the exact rebuild command for a CANN that driver runs."""
from __future__ import annotations

from pathlib import Path

import pytest
from launcher_fakes import FIXTURES, make_driver, npu_smi_with_info

from jobspec import cann
from launcher.driver_check import driver_rows

CANN_85 = "ascendai/cann:8.5.0-910b-ubuntu22.04-py3.11"


def _image(root: Path, cann_version: str | None = None, driver: str | None = None) -> Path:
    """A container root: the image's recorded CANN and the host's mounted driver version.info."""
    if cann_version:
        (root / cann.RECORD).parent.mkdir(parents=True, exist_ok=True)
        (root / cann.RECORD).write_text(cann_version + "\n")
    if driver:
        (root / cann.DRIVER_INFO).parent.mkdir(parents=True, exist_ok=True)
        (root / cann.DRIVER_INFO).write_text(f"Version={driver}\nascendhal_version=7.35.23\n")
    return root


def test_a_cann_8_era_driver_refuses_a_cann_9_1_image_naming_the_rebuild(tmp_path):
    (row,) = driver_rows(_image(tmp_path, "9.1.0", "25.0.RC1"), npu_smi=None)
    name, status, detail, fix = row
    assert status == "fail" and "driver 25.0.RC1" in detail and "CANN 9.1.0" in detail and "25.2+" in detail
    assert fix.startswith("rebuild the image on CANN 8.5")
    assert f"make image BASE_IMAGE={CANN_85}" in fix and f"docker build --build-arg BASE_IMAGE={CANN_85}" in fix


def test_a_matching_driver_passes(tmp_path):
    (row,) = driver_rows(_image(tmp_path, "8.5.0", "25.2.0"), npu_smi=None)
    assert row[1] == "ok" and "driver 25.2.0 runs the image's CANN 8.5.0" in row[2]
    (row,) = driver_rows(_image(tmp_path / "b", "9.1.0", "25.2.0"), npu_smi=None)
    assert row[1] == "ok"


@pytest.mark.parametrize("info, image, status, says", [
    ("info-procs-25.2.0-910b2.txt", "9.1.0", "ok", "driver 25.2.0 runs"),  # recorded on an 800T A2 (CANN 8.3)
    ("info.txt", "8.5.0", "fail", "upgrade the driver (Ascend HDK npu-driver) to 25.0 or newer"),  # npu-smi 23.0.6
])
def test_without_version_info_the_driver_comes_from_recorded_npu_smi(tmp_path, info, image, status, says):
    (row,) = driver_rows(_image(tmp_path, image), npu_smi=npu_smi_with_info(info))
    assert row[1] == status and says in row[2] + row[3]


def test_the_image_cann_falls_back_to_the_toolkits_install_info(tmp_path):
    make_driver(tmp_path)  # the canonical fake: driver 25.2.0, toolkit info 8.5.0
    assert cann.image_cann(tmp_path) == "8.5.0" and driver_rows(tmp_path, npu_smi=None)[0][1] == "ok"


def test_a_cann_outside_the_table_is_a_warning_and_nothing_known_is_a_failure(tmp_path):
    (row,) = driver_rows(_image(tmp_path, "8.0.0", "24.1.0"), npu_smi=None)
    assert row[1] == "warn" and "not in jobspec/cann.py's table" in row[2]
    rows = driver_rows(tmp_path / "empty", npu_smi=None)
    assert [(r[0], r[1]) for r in rows] == [("driver", "fail"), ("CANN", "fail")]


def test_the_table_orders_and_compares_driver_lines():
    assert cann.major_minor("25.3.RC1") == (25, 3) and cann.major_minor("26.0.rc1") == (26, 0)
    assert cann.major_minor("unknown") is None
    assert cann.best_for("25.0.0").line == "8.5" and cann.best_for("26.1.0").line == "9.1"
    assert cann.best_for("24.1.rc2") is None
    assert cann.release_of("9.1.0-beta.3").line == "9.1" and cann.release_of("7.0.0") is None
    assert all(r.source for r in cann.RELEASES)


def test_the_image_build_records_its_cann(tmp_path):
    """``python -m jobspec.cann record $BASE_IMAGE`` in the Dockerfile: the toolkit's own version, else the tag."""
    make_driver(tmp_path)
    assert "CANN 8.5.0: runs on Ascend HDK driver 25.0 or newer" in cann.record(tmp_path, "x:9.1.0-beta.3-910b")
    assert (tmp_path / cann.RECORD).read_text() == "8.5.0\n"
    assert "9.1.0" in cann.record(tmp_path / "bare", "ascendai/cann:9.1.0-beta.3-910b-ubuntu22.04-py3.11")
    with pytest.raises(SystemExit, match="no CANN found in the base image debian:12"):
        cann.record(tmp_path / "none", "debian:12")


def test_the_dockerfile_default_base_is_the_tables_default():
    text = (FIXTURES.parents[2] / "Dockerfile").read_text()
    assert f"ARG BASE_IMAGE={cann.DEFAULT.base_image}\n" in text and "python -m jobspec.cann record" in text


def test_the_container_page_shows_the_table_as_jobspec_cann_prints_it(capsys):
    cann.main([])
    page = (FIXTURES.parents[2] / "docs" / "container.md").read_text()
    assert all(line in page for line in capsys.readouterr().out.splitlines())
    assert "(docs/container.md)" in (FIXTURES.parents[2] / "README.md").read_text()  # the README links the page
