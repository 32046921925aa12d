"""Multi-node settings: this machine found in a hostfile by any interface address; NODE_RANK keeps the hostfile."""
from __future__ import annotations

import json
import socket

import psutil
from launcher_fakes import make_sys

import launcher.__main__ as lm
from launcher import cluster


def test_own_identities_hold_every_interface_address():
    me = cluster.own_identities()
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET:
                assert a.address in me


def test_a_hostfile_line_naming_an_interface_address_is_this_node(tmp_path, monkeypatch):
    hf = tmp_path / "hosts"
    hf.write_text("10.0.0.11 slots=8\n192.0.2.7 slots=8\n")
    addr = type(next(iter(psutil.net_if_addrs().values()))[0])  # psutil's snicaddr, wherever it lives
    fake = {"eth1": [addr(socket.AF_INET, "192.0.2.7", "255.255.255.0", None, None)]}
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: fake)  # an address no hostname resolves to
    c = cluster.detect({}, hostfile=str(hf))
    assert (c.source, c.nnodes, c.node_rank, c.master_addr) == ("hostfile", 2, 1, "10.0.0.11")


def test_node_rank_with_a_hostfile_keeps_the_hostfile(tmp_path, capsys):
    hf = tmp_path / "hosts"
    hf.write_text("10.0.0.11 slots=2\n10.0.0.12 slots=2\n")
    c = cluster.detect({"NODE_RANK": "1", "HOSTFILE": str(hf)}, me=set())  # no name matches: NODE_RANK decides
    assert (c.source, c.nnodes, c.node_rank, c.master_addr, c.nproc_per_node) == ("hostfile", 2, 1, "10.0.0.11", 2)
    assert "NODE_RANK" in c.reason
    (tmp_path / "dev").mkdir()
    host = lm.Host(env={"NODE_RANK": "1", "HOSTFILE": str(hf), "OUTPUT_DIR": str(tmp_path / "o")},
                   dev_dir=tmp_path / "dev", root=tmp_path, npu_smi=None, identities=set(),
                   sys_root=make_sys(tmp_path, {0: "0-3"}, cpuset_v2="0-3"))
    assert lm.main(["plan", "--json"], host) == 0
    t = json.loads(capsys.readouterr().out)["topology"]
    assert (t["nnodes"], t["node_rank"], t["nproc_per_node"], t["world_size"], t["master_addr"]) == \
        (2, 1, 2, 4, "10.0.0.11")
