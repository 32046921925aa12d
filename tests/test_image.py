"""`make image-test`: the image builds and its entrypoint runs plan and the tiny training inside.

Slow (minutes). It fails, not skips, when buildah/debootstrap cannot be installed; set
SKIP_IMAGE_TEST=1 to leave it out on a machine that cannot build images.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_make_image_test() -> None:
    if os.environ.get("SKIP_IMAGE_TEST") == "1":
        pytest.skip("SKIP_IMAGE_TEST=1")
    log = REPO / "build" / "image-test.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        r = subprocess.run(["make", "--no-print-directory", "image-test"], cwd=REPO, stdout=f,
                           stderr=subprocess.STDOUT, timeout=3600)
    text = log.read_text(errors="replace")
    assert r.returncode == 0, f"make image-test failed (full log: {log}):\n{text[-6000:]}"
    assert "[image-test" in text and "PASS in" in text


def _check_train():
    import importlib.util
    spec = importlib.util.spec_from_file_location("check_train", REPO / "tools" / "image" / "check_train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_check_train_reads_metrics_and_export(tmp_path: Path) -> None:
    ct = _check_train()
    (tmp_path / "metrics.jsonl").write_text('{"step": 5, "loss": 11.7}\nnot json\n{"step": 10, "loss": 9.2}\n')
    assert any("config.json missing" in p for p in ct.check(tmp_path, []))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"x")
    assert ct.check(tmp_path, []) == []
    (tmp_path / "metrics.jsonl").write_text('{"loss": 9.0}\n{"loss": 9.5}\n')
    assert any("did not fall" in p for p in ct.check(tmp_path, []))


def test_check_train_falls_back_to_log_lines(tmp_path: Path) -> None:
    ct = _check_train()
    log = tmp_path / "train.log"
    log.write_text("step 5/60 | loss 11.7383 | lr 3.00e-03\nstep 60/60 | loss=4.25e+00 |\n")
    assert ct.losses(tmp_path, [log]) == [11.7383, 4.25]


def _build(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """tools/image/build.sh with a fake `buildah` that records its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "buildah").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGS_FILE"\n')
    (bin_dir / "buildah").chmod(0o755)
    args_file = tmp_path / "args"
    args_file.unlink(missing_ok=True)
    r = subprocess.run([str(REPO / "tools" / "image" / "build.sh")], capture_output=True, text=True, timeout=60,
                       env={"PATH": f"{bin_dir}:/usr/bin:/bin", "ARGS_FILE": str(args_file), "ENGINE": "buildah",
                            **env})
    return r, args_file.read_text().splitlines() if args_file.exists() else []


def test_build_takes_the_mindspore_wheel_per_architecture(tmp_path: Path) -> None:
    wheel = tmp_path / "mindspore-2.10.0-cp311-cp311-linux_aarch64.whl"
    wheel.write_bytes(b"PK")
    r, args = _build(tmp_path, MINDSPORE_WHEEL=str(wheel))
    assert r.returncode == 0, r.stderr
    assert f"{wheel}:/run/mindspore/{wheel.name}:ro" in args
    assert f"MINDSPORE_WHEEL=/run/mindspore/{wheel.name}" in args
    url = "https://example.org/2.10.0/mindspore-2.10.0-cp311-cp311-linux_aarch64.whl"
    r, args = _build(tmp_path, MINDSPORE_WHEEL=url)
    assert r.returncode == 0 and f"MINDSPORE_WHEEL={url}" in args and not any("/run/mindspore" in a for a in args)
    r, args = _build(tmp_path, MINDSPORE_WHEEL=str(tmp_path / "missing.whl"))
    assert r.returncode == 2 and "no such file" in r.stdout and not args
    r, args = _build(tmp_path, MINDSPORE_WHEEL=str(wheel), ENGINE="docker")
    assert r.returncode == 2 and "give its URL, or ENGINE=buildah" in r.stdout


def test_dockerfile_extends_the_base_path() -> None:
    """CANN images reach Python only through PATH: the Dockerfile may prepend to it, never replace it."""
    text = (REPO / "Dockerfile").read_text()
    path_lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("PATH=")]
    assert path_lines == ["PATH=/opt/venv/bin:${PATH} \\"]
    assert "python -m jobspec.native" in text and '${MINDSPORE_WHEEL:+"$MINDSPORE_WHEEL"}' in text
