"""jobspec/cpus.py: the cgroup cpuset and CPU quota on fake sysfs/cgroup trees."""
from __future__ import annotations

import os

import pytest

from jobspec import cpus


def test_available_cpus_follow_the_cgroup_cpu_quota(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert cpus.available_cpus(tmp_path / "none") == 64
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("250000 100000\n")  # a Kubernetes limit of 2.5 CPUs
    assert cpus.available_cpus(v2) == 3
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cpus.available_cpus(v2) == 64
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("800000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpus.available_cpus(v1) == 8
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpus.available_cpus(v1) == 64


def test_allowed_cpus_prefer_the_cgroup_cpuset(tmp_path):
    assert cpus.allowed_cpus(tmp_path, lambda pid: {3, 1}) == ([1, 3], "sched_getaffinity")
    v1 = tmp_path / "fs/cgroup/cpuset"
    v1.mkdir(parents=True)
    (v1 / "cpuset.cpus").write_text("0-2,8\n")
    assert cpus.allowed_cpus(tmp_path, lambda pid: {3}) == ([0, 1, 2, 8], "/sys/fs/cgroup/cpuset/cpuset.cpus")
    (tmp_path / "fs/cgroup/cpuset.cpus.effective").write_text("4-5\n")
    assert cpus.allowed_cpus(tmp_path)[0] == [4, 5]
    (tmp_path / "fs/cgroup/cpuset.cpus.effective").write_text("5-4\n")
    with pytest.raises(ValueError, match="cpuset.cpus.effective='5-4'"):
        cpus.allowed_cpus(tmp_path)
