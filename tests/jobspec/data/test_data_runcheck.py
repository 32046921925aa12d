"""issue 19.2: a resume refused for other data must not have rebuilt the token cache first."""
from __future__ import annotations

import json

from finetune.io.checkpoint import MANIFEST
from jobspec.checkpoint_index import STATE, data_id
from jobspec.data import cache
from jobspec.data.prepare import main, prepare
from tests.jobspec.data.data_helpers import alpaca, cache_of, recipe_for, write_json


def _trained(tmp_path, recipe) -> dict:
    """The cache of ``recipe`` and a checkpoint that trained it; the cache's files -> bytes."""
    info = prepare(*cache_of(recipe), progress=False)
    ckpt = tmp_path / "out" / "checkpoints" / "step_00000008"
    ckpt.mkdir(parents=True)
    (ckpt / STATE).write_text(json.dumps({"step": 8, "identity": {"model": "m", "data": data_id(info.manifest)}}))
    (ckpt / MANIFEST).write_text(json.dumps({"step": 8, "files": {}}))
    return {p.name: p.read_bytes() for p in info.dir.iterdir()}


def test_other_data_is_refused_in_words_before_the_cache_is_written(tmp_path, capsys):
    a = write_json(tmp_path / "a.json", [alpaca(i) for i in range(12)])
    b = write_json(tmp_path / "b.json", [alpaca(i) for i in range(30, 40)])
    before = _trained(tmp_path, recipe_for(tmp_path, [a]))
    d = tmp_path / "out" / "data"
    assert main(recipe_for(tmp_path, [b])) == 2
    err = capsys.readouterr().err
    assert f"DATA was {a} (12 samples), now {b}" in err
    assert "OUTPUT_DIR=" in err and "train.resume=never" in err and "Nothing was written" in err
    assert main(recipe_for(tmp_path, [a], seq_len="256")) == 2
    assert "data.seq_len was 128, now 256" in capsys.readouterr().err
    write_json(a, [alpaca(i) for i in range(13)])
    assert main(recipe_for(tmp_path, [a])) == 2
    assert f"{a} changed since the run read it" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before


def test_resume_never_or_no_checkpoint_rebuilds(tmp_path):
    a = write_json(tmp_path / "a.json", [alpaca(i) for i in range(12)])
    b = write_json(tmp_path / "b.json", [alpaca(i) for i in range(30, 40)])
    _trained(tmp_path, recipe_for(tmp_path, [a]))
    r = recipe_for(tmp_path, [b])
    r.train.resume = "never"
    assert main(r) == 0
    assert cache.read_manifest(tmp_path / "out" / "data")["num_samples"] == 10

