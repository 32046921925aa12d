"""jobspec.native: MindSpore's native code vs this machine, read from ELF headers (issue 9, defect 4)."""
from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from jobspec import native
from jobspec.recipe_load import load_recipe
from launcher import devices, preflight

REPO = Path(__file__).resolve().parents[2]
OTHER = {"x86_64": "aarch64", "aarch64": "x86_64"}
EM = {"x86_64": 62, "aarch64": 183, "s390x": 22}


def elf_header(machine: str, big_endian: bool = False) -> bytes:
    """The 64-byte header of a 64-bit shared object (ET_DYN) for ``machine``: all the check reads."""
    order = ">" if big_endian else "<"
    ident = b"\x7fELF" + bytes([2, 2 if big_endian else 1, 1, 0]) + bytes(8)
    return ident + struct.pack(order + "HHIQQQIHHHHHH", 3, EM[machine], 1, 0, 64, 0, 0, 64, 56, 0, 64, 0, 0)


def fake_mindspore(root: Path, machine: str) -> Path:
    """A mindspore package whose lib/libmindspore_core.so is built for ``machine``."""
    pkg = root / "mindspore"
    (pkg / "lib").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('the check must not import mindspore')\n")
    (pkg / "lib" / "libmindspore_core.so").write_bytes(elf_header(machine) + bytes(200))
    return pkg


def test_elf_machine_reads_e_machine_in_either_byte_order(tmp_path):
    for machine, big in (("x86_64", False), ("aarch64", False), ("s390x", True)):
        f = tmp_path / f"{machine}.so"
        f.write_bytes(elf_header(machine, big))
        assert native.elf_machine(f) == machine
    (tmp_path / "text.so").write_text("INPUT(-lfoo)\n")  # a linker script, not ELF
    assert native.elf_machine(tmp_path / "text.so") is None


def test_the_installed_mindspore_matches_this_machine():
    """The real wheel in the venv: its core library is an ELF for this host, so the check passes."""
    c = native.check_mindspore()
    assert c.status == "ok", c
    assert native.host_machine() in c.detail and "libmindspore_core.so" in c.detail
    assert native.mindspore_mismatch() is None


@pytest.mark.parametrize("host", ["x86_64", "aarch64"])
def test_other_architecture_fails_with_the_wheel_for_this_one(tmp_path, host):
    pkg = fake_mindspore(tmp_path, OTHER[host])
    c = native.check_mindspore(pkg, machine=host, version="2.10.0")
    assert c.status == "fail"
    assert f"holds {OTHER[host]} native code" in c.detail and f"this machine is {host}" in c.detail
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    url = (f"https://ms-release.obs.cn-north-4.myhuaweicloud.com/2.10.0/MindSpore/unified/{host}/"
           f"mindspore-2.10.0-{py}-{py}-linux_{host}.whl")
    assert f"pip install --force-reinstall --no-deps {url}" in c.fix
    assert f"make setup MINDSPORE_WHEEL={url}" in c.fix and f"--build-arg MINDSPORE_WHEEL={url}" in c.fix
    assert native.check_mindspore(pkg, machine=OTHER[host], version="2.10.0").status == "ok"


def test_missing_or_unreadable_library(tmp_path):
    (tmp_path / "mindspore").mkdir()
    assert native.check_mindspore(tmp_path / "mindspore", machine="aarch64").status == "warn"


def test_preflight_row(tmp_path):
    fake = fake_mindspore(tmp_path, "x86_64")
    c = preflight.Context(load_recipe("tiny-cpu"), devices.Devices(), 1,
                          native_check=lambda: native.check_mindspore(fake, machine="aarch64"))
    rows = preflight.check_mindspore(c)
    assert [r.status for r in rows] == ["fail"] and "linux_aarch64.whl" in rows[0].fix
    assert preflight.check_mindspore in preflight.CHECKS
    assert "fix: install the aarch64 wheel" in preflight.table(rows)


def test_module_main_fails_the_image_build_on_a_mismatch(tmp_path):
    """`python -m jobspec.native` (the Dockerfile's build check) finds mindspore without importing it."""
    fake_mindspore(tmp_path, OTHER[native.host_machine()])
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    r = subprocess.run([sys.executable, "-m", "jobspec.native"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "native fail" in r.stderr and "fix: install the" in r.stderr
    r = subprocess.run([sys.executable, "-m", "jobspec.native"], env={**os.environ, "PYTHONPATH": str(REPO)},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "native ok" in r.stdout, r.stdout + r.stderr


def test_worker_start_refuses_mindspore_of_another_architecture(tmp_path, monkeypatch, capsys):
    """A rank whose MindSpore cannot load here says why and how to fix it before `import mindspore`."""
    import json

    from finetune import worker
    from jobspec import native
    from jobspec.config import to_dict
    from jobspec.recipe_load import load_recipe

    other = "x86_64" if native.host_machine() == "aarch64" else "aarch64"
    monkeypatch.setattr(native, "host_machine", lambda: other)
    monkeypatch.delenv("MS_ROLE", raising=False)
    monkeypatch.setattr(worker, "die_with_parent", lambda: None)
    monkeypatch.setattr(worker, "apply_binding", lambda: None)
    cfg = tmp_path / "plan.json"
    cfg.write_text(json.dumps({"recipe": to_dict(load_recipe("tiny-cpu", {"output_dir": str(tmp_path / "o")}))}))
    assert worker.main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"this machine is {other}" in err and "MINDSPORE_WHEEL=" in err
