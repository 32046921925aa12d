"""`python -m launcher selftest` and the preflight's self-test on NPU hosts (argument lists only; the
self-test itself is tested in tests/finetune/selftest)."""
from __future__ import annotations

import pytest

from tests.launcher.launcher_fakes import recorded_npu_smi


@pytest.fixture
def calls(monkeypatch):
    import launcher.__main__ as lm

    seen: list[list[str]] = []
    monkeypatch.setattr(lm.preflight, "run_checks", lambda ctx: [])  # every preflight row ok
    monkeypatch.setattr(lm.subprocess, "call", lambda argv, **kw: seen.append(argv) or 0)
    return seen


def _host(root, tmp_path):
    import launcher.__main__ as lm

    return lm.Host(env={"OUTPUT_DIR": str(tmp_path / "o")}, dev_dir=root / "dev", root=root, sys_root=root / "sys",
                   npu_smi=recorded_npu_smi, identities={"node-a"})


def test_preflight_on_an_npu_host_runs_the_selftest(atlas, tmp_path, calls):
    import launcher.__main__ as lm

    assert lm.main(["preflight", "--recipe", "qwen2.5-7b-full"], _host(atlas, tmp_path)) == 0
    assert len(calls) == 1 and calls[0][1:] == ["-m", "finetune.selftest", str(tmp_path / "o"), "--device", "npu"]


def test_skip_selftest_and_cpu_hosts_run_none(atlas, tmp_path, calls):
    import launcher.__main__ as lm

    assert lm.main(["preflight", "--recipe", "qwen2.5-7b-full", "--skip-selftest"], _host(atlas, tmp_path)) == 0
    assert lm.main(["preflight"], _host(tmp_path / "cpu", tmp_path)) == 0
    assert calls == []


def test_a_failed_selftest_fails_the_preflight(atlas, tmp_path, monkeypatch, calls):
    import launcher.__main__ as lm

    monkeypatch.setattr(lm.subprocess, "call", lambda argv, **kw: 1)
    assert lm.main(["preflight", "--recipe", "qwen2.5-7b-full"], _host(atlas, tmp_path)) == 1


def test_selftest_command_passes_its_options(tmp_path, calls):
    import launcher.__main__ as lm

    assert lm.main(["selftest", "--quick", "--no-collectives"], _host(tmp_path, tmp_path)) == 0
    assert calls[0][1:] == ["-m", "finetune.selftest", str(tmp_path / "o"), "--device", "cpu", "--quick",
                            "--no-collectives"]
