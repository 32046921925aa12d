"""Launch: msrun argv, plan, restarts after a failing stub worker, signal forwarding, no shell, speed."""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from launcher_fakes import make_sys, recorded_npu_smi

import launcher.__main__ as lm
from jobspec.config import REPO_ROOT
from jobspec.recipe_load import load_recipe
from launcher import launch


def test_msrun_argv_is_a_list_with_every_option(tmp_path):
    argv = launch.msrun_argv(16, 8, "10.0.0.11", 9000, 1, 300, tmp_path / "plan.json", tmp_path / "logs",
                             msrun="msrun")
    assert argv == ["msrun", "--worker_num", "16", "--local_worker_num", "8", "--master_addr", "10.0.0.11",
                    "--master_port", "9000", "--node_rank", "1", "--log_dir", str(tmp_path / "logs"),
                    "--join", "True", "--cluster_time_out", "300", str(REPO_ROOT / "finetune/worker.py"),
                    "--config", str(tmp_path / "plan.json")]


def test_worker_env_puts_the_venv_first_and_defaults_hccl():
    env = launch.worker_env({"PATH": "/usr/bin", "HCCL_EXEC_TIMEOUT": "99", "HCCL_IF_IP": "10.0.0.11"},
                            {"AF_BIND_MODE": "affinity"}, python="/opt/venv/bin/python")
    assert env["PATH"] == "/opt/venv/bin:/usr/bin" and env["PYTHONPATH"].startswith(str(REPO_ROOT))
    assert env["HCCL_EXEC_TIMEOUT"] == "99" and env["HCCL_CONNECT_TIMEOUT"] == "1200"
    assert launch.worker_env({}, {})["HCCL_EXEC_TIMEOUT"] == "1836"  # never below CANN's Atlas A2 default
    assert env["HCCL_IF_IP"] == "10.0.0.11" and env["AF_BIND_MODE"] == "affinity"


def test_cpu_workers_keep_freed_memory_unless_the_user_says_otherwise():
    """glibc reads MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ at process start: the launcher sets them for CPU
    workers (docs/memory.md, "glibc"), never for NPU workers, and a value the user set wins."""
    cpu = launch.worker_env({}, {}, cpu=True)
    assert (cpu["MALLOC_MMAP_THRESHOLD_"], cpu["MALLOC_TRIM_THRESHOLD_"]) == (str(1 << 20), str(1 << 36))
    assert "MALLOC_MMAP_THRESHOLD_" not in launch.worker_env({}, {})
    assert launch.worker_env({"MALLOC_MMAP_THRESHOLD_": "65536"}, {}, cpu=True)["MALLOC_MMAP_THRESHOLD_"] == "65536"


def run_main(args, capsys, **host):
    rc = lm.main(args, lm.Host(**host))
    out = capsys.readouterr()
    text = out.out
    plan = json.JSONDecoder().raw_decode(text[text.index("\n{") + 1:])[0] if "\n{" in text else None
    return rc, plan, out


def test_plan_on_an_atlas_worker_node(atlas, tmp_path, capsys):
    env = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.11", "MODEL_DIR": str(tmp_path / "m"), "TP": "2",
           "DATA": str(tmp_path / "d.json"), "OUTPUT_DIR": str(tmp_path / "out"), "NUMA_BIND": "affinity"}
    rc, plan, out = run_main(["plan"], capsys, env=env, dev_dir=atlas / "dev", root=atlas,
                             sys_root=atlas / "sys", npu_smi=recorded_npu_smi, identities=set())
    assert rc == 0
    assert plan["recipe"]["name"] == "qwen2.5-7b-full" and plan["recipe"]["model"]["dir"] == str(tmp_path / "m")
    assert plan["topology"]["world_size"] == 16 and plan["recipe"]["layout"]["dp"] == 8
    assert [r["global_rank"] for r in plan["ranks"]] == list(range(8, 16))
    assert plan["msrun_argv"][1:5] == ["--worker_num", "16", "--local_worker_num", "8"]
    assert plan["worker_env"]["AF_CPU_BIND_7"] == "156-167" and plan["worker_env"]["AF_BIND_MODE"] == "affinity"
    assert "explicit NNODES, NODE_RANK, MASTER_ADDR" in plan["sources"]["cluster"]
    assert "rank 7 (NPU 7, NUMA node 6): CPU affinity 156-167" in out.out
    # the plan, nothing else: the job lock of node 1 is checked, no lock file created
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["plan.json"]
    assert json.loads((tmp_path / "out/plan.json").read_text()) == plan


QWEN7B = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
          "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}


def test_plan_prints_the_memory_estimate_of_the_built_layout(atlas, tmp_path, capsys):
    """7B on 4 NPUs, tp2 dp2 sharded, grad_accum 8: bf16 weights and gradients and the fp32 accumulator (2 + 2 + 4
    bytes per parameter / tp) and the sharded fp32 state (12 / (tp*dp)), as printed, with the fp32 cast of the
    embedding shard's gradient as it is added; overrides may follow --recipe (TP 2 given: auto plans 54 GiB and
    takes TP 4, TP 2 needs 54.4)."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(QWEN7B))
    env = {"MODEL_DIR": str(tmp_path / "m"), "NPROC_PER_NODE": "4", "OUTPUT_DIR": str(tmp_path / "out")}
    host = dict(env=env, dev_dir=atlas / "dev", root=atlas, sys_root=atlas / "sys", npu_smi=recorded_npu_smi,
                identities=set())
    rc, plan, out = run_main(["plan", "--recipe", "qwen2.5-7b-full", "parallel.tp=2", "parallel.zero=1"], capsys,
                             **host)
    assert rc == 0 and plan["recipe"]["layout"]["tp"] == 2 and plan["recipe"]["layout"]["dp"] == 2
    mem = plan["memory"]
    state = mem["weights"] + mem["grads"] + mem["accumulator"] + mem["master"] + mem["optimizer"]
    assert abs(state - 7_615_616_512 * (8 / 2 + 12 / 4) - 76_032 * 3_584 * 4) / state < 1e-3
    assert "= 54.4 (embedding/LM head vocab-parallel, seq_len 4096, micro batch 1, grad_accum 8" in out.out
    rc, plan, out = run_main(["plan", "--recipe", "qwen2.5-7b-full", "parallel.vocab_parallel=false", "parallel.tp=2",
                              "parallel.zero=1"], capsys, **host)  # auto: ZeRO-1 does not fit 54 GiB with the head
    # replicated (parallel.zero: auto would take ZeRO-2 there)
    assert rc == 0 and "= 63.5 (embedding/LM head replicated" in out.out


@pytest.mark.parametrize("env,msg", [
    ({"TP": "3", "RECIPE": "qwen2.5-7b-full"},
     "TP='3' (parallel.tp): TP x PP = 3 does not divide the 8 worker(s) of this job (nodes x workers "
     "per node) (e.g. TP=2)"),
    ({"TP": "2", "DP": "2", "RECIPE": "qwen2.5-7b-full"}, "DP='2' (parallel.dp): TP=2 x DP=2 x PP=1 = 4 != world 8"),
    ({"OVERRIDES": "train.precision=bf16", "RECIPE": "tiny-cpu"}, None),
])
def test_a_layout_that_does_not_fit_the_world_is_refused_at_plan_time(atlas, tmp_path, capsys, env, msg):
    host = dict(env={"OUTPUT_DIR": str(tmp_path / "out"), **env}, dev_dir=atlas / "dev", root=atlas,
                sys_root=atlas / "sys", npu_smi=recorded_npu_smi, identities=set())
    rc, plan, out = run_main(["plan"], capsys, **host)
    if msg is None:  # tiny-cpu runs on CPU (launch.device=cpu) even on an NPU host: no bf16 matmul there
        assert rc == 2 and "OVERRIDES: train.precision='bf16': the CPU has no bf16 matmul" in out.err, out.err
    else:
        assert rc == 2 and msg in out.err, out.err
    assert not (tmp_path / "out").exists()


def test_the_plan_holds_every_derived_value(tmp_path, capsys):
    """The layout (dp, shard_optimizer ...), precision and device are written resolved; the worker only checks them."""
    (tmp_path / "dev").mkdir()
    rc, plan, out = run_main(["plan", "--json", "NPROC_PER_NODE=2", f"OUTPUT_DIR={tmp_path}/o",
                              "train.precision=auto"], capsys, env={}, dev_dir=tmp_path / "dev", root=tmp_path,
                             npu_smi=None, sys_root=make_sys(tmp_path, {0: "0-3"}, cpuset_v2="0-3"))
    assert rc == 0
    saved = json.loads(out.out)  # --json: the JSON alone
    assert saved == json.loads((tmp_path / "o/plan.json").read_text())
    r = saved["recipe"]
    assert (r["layout"]["dp"], r["layout"]["shard_optimizer"], r["train"]["precision"], r["launch"]["device"]) \
        == (2, True, "fp32", "cpu")
    assert (r["parallel"]["dp"], r["parallel"]["shard_optimizer"]) == (0, None)  # as asked
    recipe = load_recipe(raw=r)
    assert recipe.resolved(2, "cpu") == recipe  # resolving a resolved recipe changes nothing
    with pytest.raises(ValueError, match="made for 2 worker.*this job has 3"):
        recipe.resolved(3, "cpu")


def test_cpu_host_says_so_and_runs_the_worker_directly(tmp_path, capsys):
    (tmp_path / "dev").mkdir()
    rc, plan, out = run_main(["plan", f"output_dir={tmp_path}/o"], capsys, env={}, dev_dir=tmp_path / "dev",
                             root=tmp_path, sys_root=make_sys(tmp_path, {0: "0-3"}, cpuset_v2="0-3"), npu_smi=None)
    assert rc == 0 and plan["recipe"]["name"] == "tiny-cpu"
    assert "no NPU (/dev/davinciN) found: workers run on CPU" in out.out
    assert plan["msrun_argv"][0] == sys.executable and "world size 1" in plan["sources"]["launch_mode"]
    assert all(Path(p).is_absolute() and Path(p).exists() for p in plan["recipe"]["data"]["paths"])


def test_bad_settings_exit_2_listing_all(tmp_path, capsys):
    rc, _, out = run_main(["plan", "train.lr=x"], capsys, env={"TP": "two", "MASTER_PORT": "99999"},
                          dev_dir=tmp_path, npu_smi=None)
    assert rc == 2
    assert "TP='two' (parallel.tp)" in out.err and "train.lr" in out.err and "MASTER_PORT='99999'" in out.err


STUB = textwrap.dedent("""
    import os, pathlib, sys
    from jobspec.lifecycle import run_rank
    state = pathlib.Path(sys.argv[1])
    logs = pathlib.Path(sys.argv[2])
    n = int(state.read_text()) if state.exists() else 0
    state.write_text(str(n + 1))

    def main():
        print("step 1 loss 2.0", flush=True)
        if n == 0:
            raise ValueError("boom")
        print("resumed", os.environ.get("AF_BIND_MODE"))

    sys.exit(run_rank(logs, 0, main))
""")


def stub(tmp_path: Path, logs: Path | None = None) -> list[str]:
    (tmp_path / "stub.py").write_text(STUB)
    return [sys.executable, str(tmp_path / "stub.py"), str(tmp_path / "state"), str(logs or tmp_path / "logs")]


def test_restart_after_a_failing_worker(tmp_path):
    lines: list[str] = []
    rc = launch.supervise(stub(tmp_path), dict(os.environ), tmp_path / "logs", max_restarts=1, log=lines.append,
                          restart_delay_s=0)
    assert rc == 0 and (tmp_path / "state").read_text() == "2"
    text = "\n".join(lines)
    assert "first failing: rank 0: ValueError: boom" in text and "restart 1/1" in text


def test_a_device_out_of_memory_is_not_restarted(tmp_path):
    """A restart would load the model again and run out again (finetune/run/memcheck.py names the failure)."""
    lines: list[str] = []
    (tmp_path / "stub.py").write_text(STUB.replace('raise ValueError("boom")', 'from jobspec.lifecycle import '
                                                   'DeviceOutOfMemory; raise DeviceOutOfMemory("device memory ran out '
                                                   'after 0 of 5 steps")'))
    argv = [sys.executable, str(tmp_path / "stub.py"), str(tmp_path / "state"), str(tmp_path / "logs")]
    rc = launch.supervise(argv, dict(os.environ), tmp_path / "logs", max_restarts=2, log=lines.append,
                          restart_delay_s=0)
    assert rc == 1 and (tmp_path / "state").read_text() == "1"
    text = "\n".join(lines)
    assert "first failing: rank 0: DeviceOutOfMemory: device memory ran out after 0 of 5 steps" in text
    assert "not restarted" in text and "restart 1/2" not in text


def test_no_restarts_left_returns_the_job_exit_code(tmp_path):
    lines: list[str] = []
    rc = launch.supervise(stub(tmp_path), dict(os.environ), tmp_path / "logs", max_restarts=0, log=lines.append)
    assert rc == 1 and (tmp_path / "state").read_text() == "1"


def test_train_end_to_end_with_a_stub_and_shell_metacharacters(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(lm, "ensure_model", lambda r: None)
    monkeypatch.setattr(lm, "prepare_data", lambda r: 0)
    evil = f"$(touch {tmp_path}/pwned1); touch {tmp_path}/pwned2 `touch {tmp_path}/pwned3`"
    env = {"MASTER_ADDR": evil, "HCCL_SOCKET_IFNAME": evil, "MAX_RESTARTS": "1", "PATH": os.environ["PATH"],
           "OUTPUT_DIR": str(tmp_path / "out")}
    (tmp_path / "dev").mkdir()
    rc, plan, out = run_main(["train"], capsys, env=env, dev_dir=tmp_path / "dev", root=tmp_path, npu_smi=None,
                             sys_root=make_sys(tmp_path, {0: "0-1"}, cpuset_v2="0-1"),
                             command=stub(tmp_path, tmp_path / "out/logs"))
    assert rc == 0, out.out + out.err
    assert "NPU monitor: off (no NPU on this host)" in out.out
    assert not list(tmp_path.glob("pwned*"))
    saved = json.loads((tmp_path / "out/plan.json").read_text())
    assert saved["recipe"]["launch"]["master_addr"] == evil and saved["worker_env"]["HCCL_SOCKET_IFNAME"] == evil
    assert "first failing: rank 0: ValueError: boom" in out.out
    assert "resumed numactl" in out.out or "resumed affinity" in out.out


SIGNAL_CHILD = textwrap.dedent("""
    import pathlib, signal, sys, time
    mark = pathlib.Path(sys.argv[1])
    def on_term(signum, frame):
        mark.write_text("got SIGTERM")
        sys.exit(42)
    signal.signal(signal.SIGTERM, on_term)
    mark.write_text("ready")
    time.sleep(60)
""")


def sigterm_launcher(tmp_path: Path, argv: list[str], workers_only: bool) -> int:
    """Run supervise() in a subprocess, SIGTERM it once the child is ready; return its exit code."""
    mark = tmp_path / "mark"
    code = (f"import os, sys; from launcher.launch import supervise; "
            f"sys.exit(supervise({argv!r}, dict(os.environ), __import__('pathlib').Path({str(tmp_path)!r}), "
            f"max_restarts=3, under_msrun={workers_only}))")
    p = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    deadline = time.time() + 20
    while not (mark.exists() and mark.read_text() == "ready") and time.time() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    return p.wait(timeout=20)


def test_sigterm_reaches_the_child_and_its_exit_code_propagates(tmp_path):
    (tmp_path / "child.py").write_text(SIGNAL_CHILD)
    rc = sigterm_launcher(tmp_path, [sys.executable, str(tmp_path / "child.py"), str(tmp_path / "mark")], False)
    assert rc == 42  # no restart after a signal; the job's exit code
    assert (tmp_path / "mark").read_text() == "got SIGTERM"


def test_plan_is_fast_and_never_imports_mindspore(tmp_path):
    """CPU seconds, not wall time: a shared CI machine stretches wall time, not the work done (0.4 s here;
    importing mindspore alone costs several)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OUTPUT_DIR": str(tmp_path / "o")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "launcher", "plan"], env=env,
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert r.returncode == 0, r.stderr
    assert "mindspore" not in r.stderr  # -X importtime lists every imported module on stderr
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu_s < 2.0, f"launcher plan used {cpu_s:.2f} CPU seconds"


@pytest.mark.parametrize("mode", ["affinity", "numactl"])
def test_worker_applies_its_binding(tmp_path, mode):
    if mode == "numactl" and not __import__("shutil").which("numactl"):
        pytest.skip("numactl not installed")
    script = tmp_path / "w.py"
    script.write_text("import os, sys; sys.path.insert(0, sys.argv[1]); from finetune.affinity import apply_binding; "
                      "done = apply_binding(); print(sorted(os.sched_getaffinity(0)), done)")
    env = {**os.environ, "AF_BIND_MODE": mode, "DEVICE_ID": "1", "AF_CPU_BIND_1": "0", "AF_MEM_BIND_1": "0",
           "AF_NUMACTL_1": "--physcpubind=0 --membind=0", "AF_CPU_BIND_0": "1"}
    r = subprocess.run([sys.executable, str(script), str(REPO_ROOT)], env=env, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("[0] ") and (mode in r.stdout or "affinity" in r.stdout)


MS_STUB = textwrap.dedent("""
    import os, pathlib, sys, time
    from jobspec.lifecycle import run_rank

    def main():
        print("rank", os.environ.get("RANK_ID"), "local", os.environ.get("DEVICE_ID"), sys.argv[1:], flush=True)
        if os.environ.get("RANK_ID") == "1":
            done = pathlib.Path(sys.argv[0]).parent / "logs/ranks/rank_00000.json"
            while '"exited"' not in (done.read_text() if done.exists() else ""):  # rank 0 first: its log is checked
                time.sleep(0.1)
            raise ValueError("boom from rank 1")

    if os.environ.get("MS_ROLE") == "MS_WORKER":
        sys.exit(run_rank(pathlib.Path(sys.argv[0]).parent / "logs", int(os.environ["RANK_ID"]), main))
""")


@pytest.mark.slow
def test_real_msrun_with_stub_workers_reports_the_failing_rank(tmp_path):
    """Our argv against msrun 2.10 itself: 2 CPU workers, rank 1 fails, its log tail is printed."""
    msrun = Path(sys.executable).parent / "msrun"
    if not msrun.exists():
        pytest.skip("msrun not installed in this venv")
    (tmp_path / "w.py").write_text(MS_STUB)
    argv = launch.msrun_argv(2, 2, "127.0.0.1", 20000 + os.getpid() % 20000, 0, 60, tmp_path / "plan.json",
                             tmp_path / "logs", worker_script=tmp_path / "w.py")
    lines: list[str] = []
    env = launch.worker_env(os.environ, {})
    rc = launch.supervise(argv, env, tmp_path / "logs", max_restarts=0, cwd=tmp_path, log=lines.append,
                          under_msrun=True, ranks=[0, 1])
    assert rc == 1
    text = "\n".join(lines)
    assert "first failing: rank 1: ValueError: boom from rank 1" in text
    assert "local 0" in (tmp_path / "logs/worker_0.log").read_text()


PEER_STUB = textwrap.dedent("""
    import json, os, pathlib, signal, sys, time
    from jobspec.lifecycle import PeerLost, run_rank

    def main():
        ranks = pathlib.Path(sys.argv[0]).parent / "logs/ranks"
        if os.environ.get("RANK_ID") == "1":
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)
        while not (ranks / "rank_00001.json").exists():
            time.sleep(0.01)
        pid = json.loads((ranks / "rank_00001.json").read_text())["pid"]
        stat = pathlib.Path(f"/proc/{pid}/stat")
        while stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.005)
        raise PeerLost("rank 1 is gone")  # recorded well before msrun (polling once a second) reports rank 1

    if os.environ.get("MS_ROLE") == "MS_WORKER":
        sys.exit(run_rank(pathlib.Path(sys.argv[0]).parent / "logs", int(os.environ["RANK_ID"]), main))
""")


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_is_named_before_the_rank_that_lost_it(tmp_path):
    """CI once named rank 0's BrokenPipeError instead of rank 1's SIGKILL: a dead rank has no exit record,
    so its time is when the launcher noticed it, after the peer's record of the loss."""
    msrun = Path(sys.executable).parent / "msrun"
    if not msrun.exists():
        pytest.skip("msrun not installed in this venv")
    (tmp_path / "w.py").write_text(PEER_STUB)
    argv = launch.msrun_argv(2, 2, "127.0.0.1", 20000 + (os.getpid() + 7) % 20000, 0, 60, tmp_path / "plan.json",
                             tmp_path / "logs", worker_script=tmp_path / "w.py")
    lines: list[str] = []
    rc = launch.supervise(argv, launch.worker_env(os.environ, {}), tmp_path / "logs", max_restarts=0, cwd=tmp_path,
                          log=lines.append, under_msrun=True, ranks=[0, 1])
    text = "\n".join(lines)
    rank0 = json.loads((tmp_path / "logs/ranks/rank_00000.json").read_text())
    assert rank0["error"]["type"] == "PeerLost", rank0  # the race the test is about did happen
    assert rc == 137 and "first failing: rank 1: killed by SIGKILL" in text, text


MSRUN_LIKE = textwrap.dedent("""
    import os, subprocess, sys
    # like msrun: the worker runs in its own session; this parent dies on SIGTERM if it gets one
    child = subprocess.Popen([sys.executable] + sys.argv[1:], start_new_session=True)
    sys.exit(child.wait())
""")


def test_sigterm_under_an_msrun_like_parent_reaches_the_worker_not_the_parent(tmp_path):
    (tmp_path / "child.py").write_text(SIGNAL_CHILD)
    (tmp_path / "parent.py").write_text(MSRUN_LIKE)
    argv = [sys.executable, str(tmp_path / "parent.py"), str(tmp_path / "child.py"), str(tmp_path / "mark")]
    assert sigterm_launcher(tmp_path, argv, True) == 42  # the parent survived and passed its worker's code on
    assert (tmp_path / "mark").read_text() == "got SIGTERM"


def test_dry_run_train_prints_the_plan_and_starts_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(lm, "ensure_model", lambda r: pytest.fail("dry run must not create the model"))
    (tmp_path / "dev").mkdir()
    rc, plan, out = run_main(["train"], capsys, env={"DRY_RUN": "1", "OUTPUT_DIR": str(tmp_path / "o")},
                             dev_dir=tmp_path / "dev", root=tmp_path, npu_smi=None, command=stub(tmp_path))
    assert rc == 0 and plan["recipe"]["launch"]["dry_run"] is True
    assert not (tmp_path / "state").exists() and (tmp_path / "o/plan.json").is_file()
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["plan.json"]


def test_render_and_generate_get_their_own_arguments(tmp_path, capsys, monkeypatch):
    seen = {}
    monkeypatch.setattr("launcher.render.main", lambda args, env, overrides, recipe_arg:
                        seen.setdefault("render", (args, overrides, recipe_arg)) and 0)
    monkeypatch.setattr(lm.subprocess, "call", lambda argv, env: seen.setdefault("generate", argv) and 0)
    (tmp_path / "dev").mkdir()
    host = dict(env={"OUTPUT_DIR": str(tmp_path)}, dev_dir=tmp_path / "dev", npu_smi=None)
    assert lm.main(["render", "--nodes", "2", "volcano", "train.lr=1e-4", "--recipe", "tiny-cpu"],
                   lm.Host(**host)) == 0
    assert seen["render"] == (["--nodes", "2", "volcano"], ["train.lr=1e-4"], "tiny-cpu")
    assert lm.main(["generate", "--prompt", "hi; rm -rf /"], lm.Host(**host)) == 0
    assert seen["generate"][0] == sys.executable and seen["generate"][-2:] == ["--prompt", "hi; rm -rf /"]
    # the export, the base model only when generate is given --base (it refuses a missing export); the
    # recipe's device, and for export its dtype (tiny-cpu: fp32) unless the command line says otherwise
    assert seen["generate"][1:8] == [str(lm.GENERATE), "--device", "cpu", "--finetuned", str(tmp_path / "hf"),
                                     "--base-model", str(tmp_path / "base-model")]
    del seen["generate"]
    assert lm.main(["export", "--checkpoint", "step_4", "--dtype", "bf16"], lm.Host(**host)) == 0
    assert seen["generate"][1:] == [str(lm.TOOLS["export"]), "--output-dir", str(tmp_path),
                                    "--model-dir", str(tmp_path / "base-model"), "--dtype", "fp32", "--shard-size",
                                    "2GB", "--merge", "--checkpoint", "step_4", "--dtype", "bf16"]
