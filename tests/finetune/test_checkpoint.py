"""Atomic, verified, prunable, resumable checkpoints (single process)."""
import hashlib
import json
import os
import shutil
import subprocess

import mindspore as ms
import numpy as np
import pytest

from finetune.dist import RankInfo
from finetune.io.checkpoint import (
    CheckpointMismatch,
    InsufficientSpace,
    TrainerState,
    load_checkpoint,
    load_latest,
    save_checkpoint,
)
from jobspec.checkpoint_index import condemn, find_latest, run_identity, verify


def _params(seed):
    rng = np.random.default_rng(seed)
    return [ms.Parameter(ms.Tensor(rng.normal(size=(3, 2)).astype(np.float32)), name="a.weight"),
            ms.Parameter(ms.Tensor(rng.normal(size=(2,)).astype(np.float32)), name="a.bias")]


def test_save_load_round_trip_and_prune(tmp_path):
    root = tmp_path / "checkpoints"
    src = _params(0)
    for step in (10, 20, 30):
        state = TrainerState(step=step, loader={"pos": step}, scaler={"scale": 1.0, "good_steps": 0}, seed=7)
        save_checkpoint(root, state, src, {"t": np.array(step), "m.a.bias": np.ones(2, np.float32)},
                        RankInfo(), keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000020", "step_00000030"]
    latest = find_latest(root)
    assert latest.name == "step_00000030"
    manifest = json.loads((latest / "manifest.json").read_text())
    assert manifest["layout"] == {"world_size": 1, "tp": 1, "dp": 1}
    dst = _params(1)
    state, optim = load_checkpoint(latest, dst, RankInfo(), False)
    assert state.step == 30 and state.loader == {"pos": 30}
    assert int(optim["t"].item()) == 30
    for a, b in zip(src, dst):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())


def test_incomplete_checkpoint_is_ignored(tmp_path):
    root = tmp_path / "checkpoints"
    save_checkpoint(root, TrainerState(5, {}, {"scale": 1.0, "good_steps": 0}, 0), _params(0), {"t": np.array(1)},
                    RankInfo(), keep=3)
    (root / "step_00000009.tmp").mkdir()  # a crash mid-write
    (root / "step_00000010").mkdir()  # no manifest: never published
    assert find_latest(root).name == "step_00000005"


def test_layout_mismatch_is_a_clear_error(tmp_path):
    root = tmp_path / "checkpoints"
    path = save_checkpoint(root, TrainerState(1, {}, {"scale": 1.0, "good_steps": 0}, 0), _params(0),
                           {"t": np.array(1)}, RankInfo(), keep=1)
    m = json.loads((path / "manifest.json").read_text())
    m["layout"]["tp"] = 2
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointMismatch, match="parallel.tp"):
        load_checkpoint(path, _params(0), RankInfo(), False)


def test_shape_mismatch_names_the_parameter_and_leaves_weights_alone(tmp_path):
    """E.g. a checkpoint of a vocab-parallel run resumed with parallel.vocab_parallel=false."""
    root = tmp_path / "checkpoints"
    path = save_checkpoint(root, TrainerState(1, {}, {"scale": 1.0, "good_steps": 0}, 0), _params(0),
                           {"t": np.array(1)}, RankInfo(), keep=1)
    dst = _params(1)
    dst[0] = ms.Parameter(ms.Tensor(np.zeros((6, 2), np.float32)), name="a.weight")
    with pytest.raises(ValueError, match=r"a.weight \[3, 2\] vs \[6, 2\].*train.resume=never"):
        load_checkpoint(path, dst, RankInfo(), False)
    np.testing.assert_array_equal(dst[1].asnumpy(), _params(1)[1].asnumpy())


def _save(root, step, keep=5, identity=None, seed=0):
    state = TrainerState(step, {"pos": step}, {"scale": 1.0, "good_steps": 0}, 0, identity=identity or {})
    return save_checkpoint(root, state, _params(seed + step), {"t": np.array(step), "m": np.ones(4, np.float32)},
                           RankInfo(), keep=keep)


def test_the_manifest_lists_every_file_with_size_and_sha256(tmp_path):
    path = _save(tmp_path / "checkpoints", 3)
    files = json.loads((path / "manifest.json").read_text())["files"]
    on_disk = sorted(p.name for p in path.iterdir() if p.name != "manifest.json")
    assert sorted(files) == on_disk == ["model_rank00000.safetensors", "optim_rank00000.safetensors",
                                        "trainer_state.json"]
    for name, entry in files.items():
        data = (path / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert verify(path) is None


def _truncate(p):
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _flip(p):
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, name, reason", [
    (_truncate, "model_rank00000.safetensors", "truncated or overwritten"),
    (_truncate, "optim_rank00000.safetensors", "truncated or overwritten"),
    (_flip, "model_rank00000.safetensors", "differ from the manifest's sha256"),
    (lambda p: p.write_text('{"step": 20, "load'), "trainer_state.json", "truncated or overwritten"),
    (lambda p: p.write_text('{"step": 2'), "manifest.json", "unreadable"),
])
def test_a_damaged_newest_checkpoint_is_skipped_naming_the_file(tmp_path, damage, name, reason):
    root = tmp_path / "checkpoints"
    _save(root, 10)
    newest = _save(root, 20)
    damage(newest / name)
    lines, dst = [], _params(99)
    path, state, optim = load_latest(root, dst, RankInfo(), False, log=lines.append)
    assert path.name == "step_00000010" and state.step == 10 and int(optim["t"].item()) == 10
    np.testing.assert_array_equal(dst[0].asnumpy(), _params(10)[0].asnumpy())
    assert len(lines) == 1 and f"skipping {newest}" in lines[0] and str(newest / name) in lines[0]
    assert reason in lines[0]


def test_an_explicit_damaged_checkpoint_is_an_error_naming_the_file(tmp_path):
    path = _save(tmp_path / "checkpoints", 10)
    _truncate(path / "optim_rank00000.safetensors")
    with pytest.raises(ValueError, match=r"optim_rank00000.safetensors: \d+ bytes, the manifest says \d+ \(truncated"):
        load_checkpoint(path, _params(1), RankInfo(), False)


def test_pruning_counts_only_verified_checkpoints(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, 10, keep=2)
    damaged = _save(root, 20, keep=2)
    _truncate(damaged / "optim_rank00000.safetensors")
    _save(root, 30, keep=2)  # naive pruning would delete step 10 and leave only 20 (damaged) and 30
    assert sorted(p.name for p in root.iterdir()) == ["step_00000010", "step_00000020", "step_00000030"]
    assert verify(root / "step_00000010") is None
    _save(root, 40, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000020", "step_00000040"]  # the damaged one stays


def test_no_usable_checkpoint_says_so(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (10, 20):
        (_save(root, step) / "manifest.json").unlink()
    lines = []
    assert load_latest(root, _params(1), RankInfo(), False, log=lines.append) is None
    assert len(lines) == 3 and all("no manifest.json (deleted" in line for line in lines[:2])
    assert "no usable checkpoint" in lines[2] and "2 without a manifest" in lines[2]
    assert "starting from step 0" in lines[2]


def test_another_model_or_data_is_refused_naming_both_and_the_fix(tmp_path, tiny_hf_dir):
    a, b = tiny_hf_dir("a", seed=0), tiny_hf_dir("b", seed=1)
    cache = tmp_path / "cache"
    cache.mkdir()
    src = {"path": "/data/a.json", "weight": 1.0, "size": 10, "mtime": 1.0, "sha256": "ab"}
    manifest = {"settings": {"seq_len": 64}, "sources": [src], "num_samples": 4, "num_tokens": 99,
                "created": "2026-01-01T00:00:00"}  # the fields of a token cache's manifest.json
    (cache / "manifest.json").write_text(json.dumps(manifest))
    ident_a, ident_b = run_identity(a, cache), run_identity(b, cache)
    assert ident_a["model"] != ident_b["model"] and ident_a["data"] == ident_b["data"]
    assert run_identity(a, cache) == ident_a
    root = tmp_path / "checkpoints"
    _save(root, 10, identity=ident_a)
    with pytest.raises(CheckpointMismatch) as e:
        load_latest(root, _params(1), RankInfo(), False, identity=ident_b)
    msg = str(e.value)
    assert ident_a["model"] in msg and ident_b["model"] in msg and str(a) in msg
    assert "another directory (OUTPUT_DIR=" in msg and "train.resume=never" in msg
    rebuilt = {**manifest, "sources": [{**src, "path": "/moved/a.json", "mtime": 2.0}], "created": "2026-02-02"}
    (cache / "manifest.json").write_text(json.dumps(rebuilt))
    assert run_identity(a, cache) == ident_a  # the same data moved, touched or re-prepared
    (cache / "manifest.json").write_text(json.dumps({**manifest, "num_tokens": 100}))
    with pytest.raises(CheckpointMismatch, match="token cache is"):
        load_latest(root, _params(1), RankInfo(), False, identity=run_identity(a, cache))


def test_a_full_disk_stops_before_writing_and_leaves_older_checkpoints(tmp_path):
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a small tmpfs")
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        root = mnt / "checkpoints"
        _save(root, 10)
        before = sorted(p.name for p in root.rglob("*"))
        big = [ms.Parameter(ms.Tensor(np.zeros((6144, 1024), np.float32)), name="big.weight")]  # 24 MiB
        with pytest.raises(InsufficientSpace, match=r"needs \d+ MiB, \d+ MiB are free"):
            save_checkpoint(root, TrainerState(20, {}, {"scale": 1.0, "good_steps": 0}, 0), big,
                            {"t": np.array(1)}, RankInfo(), keep=1)
        assert sorted(p.name for p in root.rglob("*")) == before  # no partial step_20, step_10 untouched
        assert verify(root / "step_00000010") is None
    finally:
        subprocess.run(["umount", str(mnt)])


def test_resume_never_moves_the_old_checkpoints_aside(tmp_path):
    """issue 19.2: train.resume=never must not mix a new run's checkpoints with (or prune into) the old ones."""
    from jobspec.checkpoint_index import archive_checkpoints

    _save(tmp_path / "checkpoints", 10)
    said = []
    dest = archive_checkpoints(tmp_path, said.append)
    assert dest is not None and dest.name.startswith("checkpoints.old-") and (dest / "step_00000010").is_dir()
    assert not (tmp_path / "checkpoints").exists() and str(dest) in said[0]
    assert archive_checkpoints(tmp_path, said.append) is None and len(said) == 1


def test_unhealthy_and_manifestless_checkpoints_are_passed_over_with_the_reason(tmp_path):
    """issue 19.11: a checkpoint written during a run of non-finite steps is never resumed, and pruning keeps
    the newest healthy one; 19.14: a step directory whose manifest.json was deleted is skipped, saying why."""
    root = tmp_path / "checkpoints"
    src = _params(0)

    def save(step, streak, keep=1):
        state = TrainerState(step, {"pos": step}, {"scale": 1.0, "good_steps": 0}, 0, skipped_steps=5,
                             bad_streak=streak)
        save_checkpoint(root, state, src, {"t": np.array(step)}, RankInfo(), keep=keep)

    save(10, 0)
    save(20, 3)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000010", "step_00000020"]  # 10: newest healthy
    save(30, 0, keep=3)
    (root / "step_00000030" / "manifest.json").unlink()
    said = []
    found = load_latest(root, _params(1), RankInfo(), False, log=said.append)
    assert found, said
    path, state, _ = found
    assert path.name == "step_00000010" and state.skipped_steps == 5
    assert "step_00000030: no manifest.json" in said[0]
    assert "step_00000020: unhealthy, written during 3 consecutive steps with non-finite gradients" in said[1]
    condemn(root / "step_00000010", "every one of the 2 steps after it had non-finite gradients")  # issue 31
    said.clear()
    assert load_latest(root, _params(1), RankInfo(), False, log=said.append) is None
    assert any("step_00000010: unhealthy, every one of the 2 steps after it had non-finite gradients" in line
               for line in said), said
    assert verify(root / "step_00000010") is None  # the mark is beside the manifest's files, not among them


def test_a_base_model_edited_in_the_middle_is_another_model(tmp_path, tiny_hf_dir):
    """issue 19.12: only each file's size and first and last MiB were hashed; an edit in the middle resumed."""
    model = tiny_hf_dir("m", vocab_size=32768)
    cache = tmp_path / "cache"
    before = run_identity(model, cache)
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    assert len(data) > 3 << 20  # an edit outside the first and last MiB
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    after = run_identity(model, cache)
    assert after["model"] != before["model"]
    root = tmp_path / "checkpoints"
    _save(root, 10, identity=before)
    with pytest.raises(CheckpointMismatch, match=f"base model is .*\\({model}\\).*\\({model}, same directory, "
                                                 "other contents\\)"):
        load_latest(root, _params(1), RankInfo(), False, identity=after)


@pytest.mark.parametrize("where", ["weights", "manifest", "publish"])
def test_a_disk_full_inside_the_write_publishes_nothing_and_leaves_no_tmp(tmp_path, monkeypatch, where):
    """Issue 31: ENOSPC while the checkpoint is written (safetensors raises SafetensorError, not OSError; the
    manifest and the publishing rename raise OSError) gives "nothing was published", no step_N.tmp, the older
    checkpoint untouched."""
    import errno

    from safetensors import SafetensorError

    import finetune.io.checkpoint as ck

    root = tmp_path / "checkpoints"
    _save(root, 10)
    full = OSError(errno.ENOSPC, "No space left on device")

    def fail(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)") \
            if where == "weights" else full

    monkeypatch.setattr(ck, {"weights": "save_file", "manifest": "_write_manifest", "publish": "publish"}[where], fail)
    with pytest.raises(InsufficientSpace, match="No space left on device.*nothing was published"):
        _save(root, 20)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000010"]
    assert verify(root / "step_00000010") is None
