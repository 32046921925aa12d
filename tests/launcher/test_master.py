"""MASTER_ADDR's name resolved with retries (launcher/master.py) before preflight and msrun see it."""
from __future__ import annotations

import socket
import sys

import pytest
from launcher_fakes import make_sys

import launcher.__main__ as lm
from launcher import cli, master


class FlakyDns:
    """Fails ``failures`` times (as a headless Service without pod 0 Ready does), then answers ``ip``."""

    def __init__(self, failures: int, ip: str = "10.244.0.7"):
        self.failures, self.ip, self.calls = failures, ip, []

    def __call__(self, host: str) -> str:
        self.calls.append(host)
        if len(self.calls) <= self.failures:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return self.ip


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_a_name_that_resolves_after_three_failures():
    dns, clock, said = FlakyDns(3), Clock(), []
    ip = master.resolve_master("job-worker-0.job", 60, dns, clock.sleep, clock, said.append, poll_s=2)
    assert ip == "10.244.0.7" and dns.calls == ["job-worker-0.job"] * 4 and clock.now == 6
    assert "does not resolve yet" in said[0] and "launch.master_resolve_timeout_s" in said[0]
    assert said[-1] == "MASTER_ADDR=job-worker-0.job resolves to 10.244.0.7 after 4 tries; msrun gets the address"


def test_a_name_that_never_resolves_is_refused_naming_host_timeout_and_fix():
    dns, clock = FlakyDns(10**9), Clock()
    with pytest.raises(master.MasterUnresolved) as e:
        master.resolve_master("job-worker-0.job", 30, dns, clock.sleep, clock, lambda m: None, poll_s=2)
    msg = str(e.value)
    assert clock.now == 30 and len(dns.calls) == 16
    for part in ("MASTER_ADDR=job-worker-0.job", "launch.master_resolve_timeout_s=30 s",
                 "--publish-not-ready-addresses=true", "launch.master_resolve_timeout_s=1200"):
        assert part in msg


def test_an_ip_is_not_looked_up():
    assert master.resolve_master("10.0.0.1", 30, FlakyDns(10**9)) == "10.0.0.1"
    assert master.resolve_master("[fe80::1]", 30, FlakyDns(10**9)) == "[fe80::1]"


def _job(tmp_path, resolver, *settings):
    (tmp_path / "dev").mkdir(exist_ok=True)
    env = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "job-worker-0.job", "OUTPUT_DIR": str(tmp_path / "o")}
    host = lm.Host(env=env, dev_dir=tmp_path / "dev", root=tmp_path, npu_smi=None, identities={"job-worker-1"},
                   sys_root=make_sys(tmp_path, {0: "0-1"}, cpuset_v2="0-1"), resolver=resolver,
                   command=[sys.executable, "-c", "raise SystemExit(3)"])
    args = cli.parse(cli.build_parser(lm.COMMANDS, ""), ["preflight", *settings], lm.COMMANDS)
    return lm.resolve(args, host), host


def test_msrun_and_the_plan_get_the_address(tmp_path, capsys):
    job, host = _job(tmp_path, FlakyDns(0))
    assert job.plan.topology.master_addr == "job-worker-0.job"  # `plan` starts nothing and waits for nothing
    assert lm.pin_master(job, host)
    plan = job.plan.to_json()
    argv = plan["msrun_argv"]
    assert argv[argv.index("--master_addr") + 1] == "10.244.0.7" and argv == job.plan.argv
    assert job.recipe.launch.master_addr == "10.244.0.7" == plan["recipe"]["launch"]["master_addr"]
    assert (plan["topology"]["master_host"], plan["topology"]["master_addr"]) == ("job-worker-0.job", "10.244.0.7")
    assert "MASTER_ADDR=job-worker-0.job resolves to 10.244.0.7" in capsys.readouterr().out


def test_train_stops_before_preflight_when_the_master_never_resolves(tmp_path, capsys):
    (tmp_path / "dev").mkdir()
    env = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "job-worker-0.job", "OUTPUT_DIR": str(tmp_path / "o"),
           "OVERRIDES": "launch.master_resolve_timeout_s=1"}
    host = lm.Host(env=env, dev_dir=tmp_path / "dev", root=tmp_path, npu_smi=None, identities={"job-worker-1"},
                   sys_root=make_sys(tmp_path, {0: "0-1"}, cpuset_v2="0-1"), resolver=FlakyDns(10**9),
                   command=[sys.executable, "-c", "raise SystemExit(3)"])
    assert lm.main(["train"], host) == 1
    out = capsys.readouterr()
    assert "MASTER_ADDR=job-worker-0.job did not resolve within launch.master_resolve_timeout_s=1 s" in out.err
    assert "status" not in out.out and "Traceback" not in out.out + out.err  # no preflight table, nothing started
    assert not (tmp_path / "o").exists()
