"""Each node's launcher, before its workers start (launcher/rundir_prep.py): stale temporary
directories removed, train.resume=never's checkpoints moved aside, the base model hashed once into the plan.
Two "nodes" on one machine, node-local or sharing one OUTPUT_DIR, as fakes (no msrun)."""
from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
from launcher_fakes import make_sys

import launcher.__main__ as lm
from jobspec import checkpoint_index
from jobspec.fsutil import _me
from launcher import cli
from launcher.rundir_prep import tidy_run_dir


@pytest.fixture
def reads(monkeypatch):
    seen = []
    real = checkpoint_index.file_hash
    monkeypatch.setattr(checkpoint_index, "file_hash", lambda path: (seen.append(path), real(path))[1])
    return seen


def _job(tmp_path, out, node_rank, *settings):
    (tmp_path / "dev").mkdir(exist_ok=True)
    env = {"NNODES": "2", "NODE_RANK": str(node_rank), "MASTER_ADDR": "10.0.0.1", "OUTPUT_DIR": str(out)}
    host = lm.Host(env=env, dev_dir=tmp_path / "dev", root=tmp_path, npu_smi=None, identities={"10.0.0.9"},
                   sys_root=make_sys(tmp_path, {0: "0-1"}, cpuset_v2="0-1"))
    args = cli.parse(cli.build_parser(lm.COMMANDS, ""), ["train", *settings], lm.COMMANDS)
    job = lm.resolve(args, host)
    lm.ensure_model(job.recipe)  # the tiny default, as train does before
    return job


def _leftovers(out):
    """An earlier run's checkpoint and a temporary directory of a killed process of this host."""
    (out / "checkpoints" / "step_00000010").mkdir(parents=True)
    (out / "checkpoints" / "step_00000010" / "manifest.json").write_text("{}")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = out / f".hf.tmp-{_me().rsplit('-', 1)[0]}-{dead.pid}"
    stale.mkdir()
    return stale


def test_node_local_output_dirs_are_tidied_and_hashed_by_each_node(tmp_path, reads, capsys):
    outs = [tmp_path / "node0", tmp_path / "node1"]
    jobs = [_job(tmp_path, out, n, "train.resume=never") for n, out in enumerate(outs)]
    stale = [_leftovers(out) for out in outs]
    for job in jobs:
        tidy_run_dir(job.recipe, job.plan, print)
    text = capsys.readouterr().out
    for out, s in zip(outs, stale):  # node 1 too (the main rank of node 0 cannot reach node 1's disk)
        assert not s.exists() and f"removed {s}" in text
        assert not (out / "checkpoints").exists() and len(list(out.glob("checkpoints.old-*"))) == 1
    assert jobs[0].plan.model_hash and jobs[0].plan.model_hash == jobs[1].plan.model_hash
    # moved aside once: a restart of this job resumes its own checkpoints instead of moving them too
    assert all(job.plan.recipe["train"]["resume"] == "auto" for job in jobs)
    assert len(reads) == 2  # once per node: each its own model copy and cache


def test_two_nodes_sharing_one_output_dir_race_without_error_or_double_work(tmp_path, reads, capsys):
    out = tmp_path / "shared"
    jobs = [_job(tmp_path, out, n, "train.resume=never") for n in (0, 1)]
    stale = _leftovers(out)
    errors = []

    def tidy(job):
        try:
            tidy_run_dir(job.recipe, job.plan, print)
        except Exception as e:  # the assertion names it
            errors.append(e)

    threads = [threading.Thread(target=tidy, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    archived = list(out.glob("checkpoints.old-*"))
    assert len(archived) == 1 and (archived[0] / "step_00000010" / "manifest.json").is_file()
    assert not (out / "checkpoints").exists() and not stale.exists()
    assert capsys.readouterr().out.count("earlier checkpoints moved to") == 1
    assert jobs[0].plan.model_hash == jobs[1].plan.model_hash != ""
    tidy_run_dir(jobs[1].recipe, jobs[1].plan, print)  # a later rerun of one node: nothing to move, nothing re-read
    assert len(list(out.glob("checkpoints.old-*"))) == 1 and len(reads) <= 2


def test_train_hashes_once_into_the_plan_and_a_rerun_reads_nothing(tmp_path, reads, monkeypatch, capsys):
    """The worker (here a stub) finds the identity in plan.json; the second train reads no weight file."""
    monkeypatch.setattr(lm, "prepare_data", lambda r: 0)
    got = tmp_path / "got"
    stub = [sys.executable, "-c", "import json, pathlib, sys; pathlib.Path(sys.argv[2]).write_text("
            "json.loads(pathlib.Path(sys.argv[1]).read_text())['model_hash'])", str(tmp_path / "out/plan.json"),
            str(got)]
    (tmp_path / "dev").mkdir()
    host = lm.Host(env={"OUTPUT_DIR": str(tmp_path / "out")}, dev_dir=tmp_path / "dev", root=tmp_path,
                   npu_smi=None, sys_root=make_sys(tmp_path, {0: "0-1"}, cpuset_v2="0-1"), command=stub)
    assert lm.main(["train"], host) == 0, capsys.readouterr()
    first = got.read_text()
    assert first and len(reads) == 1  # the tiny model: one weight file, read once by this node
    assert json.loads((tmp_path / "out/plan.json").read_text())["model_hash"] == first
    assert lm.main(["train"], host) == 0
    assert got.read_text() == first and len(reads) == 1  # remembered in OUTPUT_DIR/.model-hashes.json
