"""Atomic, prunable, resumable checkpoints (single process)."""
import json

import mindspore as ms
import numpy as np
import pytest

from finetune.checkpoint import TrainerState, find_latest, load_checkpoint, save_checkpoint
from finetune.dist import RankInfo


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
    state, optim = load_checkpoint(latest, dst, RankInfo())
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
    with pytest.raises(ValueError, match="parallel.tp"):
        load_checkpoint(path, _params(0), RankInfo())


def test_shape_mismatch_names_the_parameter_and_leaves_weights_alone(tmp_path):
    """E.g. a checkpoint of a vocab-parallel run resumed with parallel.vocab_parallel=false."""
    root = tmp_path / "checkpoints"
    path = save_checkpoint(root, TrainerState(1, {}, {"scale": 1.0, "good_steps": 0}, 0), _params(0),
                           {"t": np.array(1)}, RankInfo(), keep=1)
    dst = _params(1)
    dst[0] = ms.Parameter(ms.Tensor(np.zeros((6, 2), np.float32)), name="a.weight")
    with pytest.raises(ValueError, match=r"a.weight \[3, 2\] vs \[6, 2\].*train.resume=never"):
        load_checkpoint(path, dst, RankInfo())
    np.testing.assert_array_equal(dst[1].asnumpy(), _params(1)[1].asnumpy())
