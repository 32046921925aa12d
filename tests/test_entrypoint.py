"""entrypoint.sh under bash with a stub `python` on PATH that records its argv and environment."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.__main__ import COMMANDS

REPO = Path(__file__).resolve().parent.parent
ENTRY = REPO / "entrypoint.sh"

STUB = """#!/usr/bin/env bash
printf '%s\\0' "$@" > "$STUB_DIR/argv"
env -0 > "$STUB_DIR/env"
exit "${STUB_RC:-0}"
"""


@pytest.fixture
def stub(tmp_path: Path) -> Path:
    """A directory holding the fake `python`; its recordings land there too."""
    d = tmp_path / "bin"
    d.mkdir()
    (d / "python").write_text(STUB)
    (d / "python").chmod(0o755)
    return d


def run_entry(stub: Path, *args: str, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.CompletedProcess:
    base = {"PATH": f"{stub}:/usr/bin:/bin", "STUB_DIR": str(stub), "HOME": str(stub),
            "ASCEND_BASE": str(stub / "no-ascend")}
    return subprocess.run(["bash", str(ENTRY), *args], env={**base, **(env or {})}, cwd=cwd,
                          capture_output=True, text=True, timeout=30)


def argv(stub: Path) -> list[str]:
    return (stub / "argv").read_text().split("\0")[:-1]


def child_env(stub: Path) -> dict[str, str]:
    pairs = [e.split("=", 1) for e in (stub / "env").read_text().split("\0") if "=" in e]
    return dict(pairs)


def test_default_command_is_train(stub: Path) -> None:
    r = run_entry(stub)
    assert r.returncode == 0, r.stderr
    assert argv(stub) == ["-m", "launcher", "train"]
    assert child_env(stub)["PYTHONPATH"].split(":")[0] == str(REPO)


@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_launcher_commands_pass_args_unchanged(stub: Path, cmd: str) -> None:
    args = ["--recipe", "tiny-cpu", "train.lr=1e-5", "a b", "x=$(id)", ""]
    r = run_entry(stub, cmd, *args)
    assert r.returncode == 0, r.stderr
    assert argv(stub) == ["-m", "launcher", cmd, *args]


def test_overrides_without_command_mean_train(stub: Path) -> None:
    r = run_entry(stub, "train.max_steps=2", "--recipe", "tiny-cpu")
    assert r.returncode == 0, r.stderr
    assert argv(stub) == ["-m", "launcher", "train", "train.max_steps=2", "--recipe", "tiny-cpu"]


def test_exit_code_is_the_launchers(stub: Path) -> None:
    assert run_entry(stub, "plan", env={"STUB_RC": "7"}).returncode == 7


def test_shell_metacharacters_never_executed(stub: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = f"$(touch {marker}); touch {marker} `touch {marker}` | touch {marker}"
    env = {"RECIPE": "qwen2.5-7b-full", "MODEL_DIR": evil, "DATA": evil, "OVERRIDES": evil,
           "OUTPUT_DIR": evil, "NNODES": evil, "MASTER_ADDR": evil}
    r = run_entry(stub, "train", evil, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert argv(stub) == ["-m", "launcher", "train", evil]
    assert all(child_env(stub)[k] == v for k, v in env.items())
    r = run_entry(stub, evil, env=env, cwd=tmp_path)
    assert r.returncode == 2 and "unknown command" in r.stderr
    assert not marker.exists()


def real_launcher(tmp_path: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The entrypoint in front of the real launcher (this interpreter as `python`)."""
    base = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path),
            "ASCEND_BASE": str(tmp_path / "no-ascend"), "OUTPUT_DIR": str(tmp_path / "out")}
    return subprocess.run(["bash", str(ENTRY), *args], env={**base, **env}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


def test_launcher_names_the_docker_flags_for_missing_settings(tmp_path: Path) -> None:
    """The checks live in the launcher; its fixes carry the `-e VAR=...` to add to `docker run`."""
    r = real_launcher(tmp_path, "preflight", env={"RECIPE": "qwen2.5-7b-full"})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "-e MODEL_DIR=/models/Qwen2.5-7B-Instruct" in r.stdout and "-e DATA=/data/train.jsonl" in r.stdout


def test_launcher_refuses_a_node_without_its_rank(tmp_path: Path) -> None:
    r = real_launcher(tmp_path, "plan", env={"NNODES": "2", "MASTER_ADDR": "10.0.0.1"})
    assert r.returncode == 2 and "-e NODE_RANK=1" in r.stderr, r.stdout + r.stderr


def test_bash_and_other_programs_run(stub: Path) -> None:
    r = run_entry(stub, "bash", "-c", "echo hi")
    assert r.returncode == 0 and r.stdout == "hi\n"
    r = run_entry(stub, "echo", "a;b", "$(x)")
    assert r.stdout == "a;b $(x)\n"
    r = run_entry(stub, "no-such-program")
    assert r.returncode == 2 and "unknown command" in r.stderr


def test_cann_env_sourced_even_with_unset_vars(stub: Path) -> None:
    """Toolkit, the IR compiler's script under ASCEND_TOOLKIT_HOME, ATB with --cxx_abi: as the CANN image does."""
    ascend = stub / "no-ascend"
    toolkit, home, atb = ascend / "ascend-toolkit", ascend / "cann-9.1.0", ascend / "nnal" / "atb"
    ir = home / "share" / "info" / "ascendnpu-ir" / "bin"
    for d in (toolkit, ir, atb):
        d.mkdir(parents=True)
    (toolkit / "set_env.sh").write_text(
        f'export ASCEND_TOOLKIT_HOME="{home}"\n'
        'export LD_LIBRARY_PATH="/cann/lib:${LD_LIBRARY_PATH}"\n'  # unset under `set -u`
        '[ -n "$NOT_SET_ANYWHERE" ] && echo never\n')  # a failing last line under `set -e`
    (ir / "set_env.sh").write_text('export PATH="/cann/ir/bin:$PATH"\n')
    (atb / "set_env.sh").write_text(  # like ATB's script: without --cxx_abi it would probe torch
        'case "$1" in --cxx_abi=1) export ATB_HOME_PATH=/atb/cxx_abi_1 ;; *) return 1 ;; esac\n')
    r = run_entry(stub, "plan")
    assert r.returncode == 0, r.stderr
    env = child_env(stub)
    assert env["ASCEND_TOOLKIT_HOME"] == str(home)
    assert env["LD_LIBRARY_PATH"] == "/cann/lib:"
    assert env["PATH"].startswith("/cann/ir/bin:")
    assert env["ATB_HOME_PATH"] == "/atb/cxx_abi_1"
    assert argv(stub) == ["-m", "launcher", "plan"]  # the scripts' own arguments do not leak into ours


def test_shellcheck_clean() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed")
    r = subprocess.run(["shellcheck", "-S", "warning", str(ENTRY)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == "", r.stdout


def test_entrypoint_is_executable() -> None:
    assert os.access(ENTRY, os.X_OK)
