"""Export and resharding of training checkpoints (single process; msrun cases in dist/test_reshard.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from finetune.dist import RankInfo

REPO = Path(__file__).resolve().parents[2]


def _model(ms, model_dir, rank=RankInfo(), **kw):
    from finetune.io.hf_io import load_hf_config, load_weights
    from finetune.model.decoder import DecoderLM, ModelConfig

    model = DecoderLM(ModelConfig.from_dict(load_hf_config(model_dir)), rank, **kw)
    if rank.tp == 1:
        load_weights(model, model_dir)
    return model


def _checkpoint(ms, tmp_path, src):
    """A one-process checkpoint of ``src``'s weights with random Adam moments; returns (dir, model, moments)."""
    from finetune.io.checkpoint import TrainerState, save_checkpoint

    model = _model(ms, src)
    rng = np.random.default_rng(0)
    moments = {f"{k}.{p.name}": rng.standard_normal(p.shape).astype(np.float32)
               for p in model.trainable_params() for k in ("m", "v")}
    path = save_checkpoint(tmp_path / "run" / "checkpoints", TrainerState(7, {}, {"scale": 1.0, "good_steps": 0}, 0),
                           model.trainable_params(), {"t": np.array(7, np.int64), **moments}, RankInfo(), keep=2)
    return path, model, moments


def test_export_equals_the_live_models_export(ms_cpu, tmp_path, tiny_hf_dir):
    from finetune.export import main
    from finetune.io.hf_io import export_hf

    src = tiny_hf_dir(tie_word_embeddings=False)
    path, model, _ = _checkpoint(ms_cpu, tmp_path, src)
    export_hf(model, src, tmp_path / "live", dtype="bf16", shard_size_bytes=30_000)
    old = os.umask(0o077)
    try:
        rc = main(["--checkpoint", "step_7", "--output-dir", str(tmp_path / "run"), "--model-dir", str(src),
                   "--shard-size", "30KB"])
    finally:
        os.umask(old)
    assert rc == 0
    out = tmp_path / "run" / "hf-step_00000007"
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(p.name for p in (tmp_path / "live").iterdir()) and len(files) > 5  # several shards
    for f in files:
        assert (out / f).read_bytes() == (tmp_path / "live" / f).read_bytes(), f
        assert (out / f).stat().st_mode & 0o777 == 0o644
    assert out.stat().st_mode & 0o777 == 0o755
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_export_names_missing_checkpoints(tmp_path, tiny_hf_dir, capsys):
    from finetune.export import main

    (tmp_path / "run" / "checkpoints" / "step_00000002").mkdir(parents=True)  # incomplete: no manifest
    assert main(["--checkpoint", "step_9", "--output-dir", str(tmp_path / "run"), "--model-dir", "x"]) == 2
    err = capsys.readouterr().err
    assert "step_00000009" in err and "saved in" in err and "none" in err


def test_export_never_replaces_the_run_or_the_users_directory(ms_cpu, tmp_path, tiny_hf_dir, capsys):
    """issue 19.1: `export --out $OUTPUT_DIR` deleted the run; a directory of the user's own files lost them."""
    from finetune.export import main

    src = tiny_hf_dir()
    path, _, _ = _checkpoint(ms_cpu, tmp_path, src)
    run = tmp_path / "run"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    for out, said in ((run, "holds"), (tmp_path, "holds"), (mine, "not written by ascend-finetune")):
        assert main(["--checkpoint", "latest", "--output-dir", str(run), "--model-dir", str(src),
                     "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert said in err and str(out) in err and "new" in err
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    assert (mine / "notes.txt").read_text() == "precious"
    assert main(["--checkpoint", "latest", "--output-dir", str(run), "--model-dir", str(src),
                 "--out", str(tmp_path / "hf")]) == 0  # a new directory, then again over its own export
    assert main(["--checkpoint", "latest", "--output-dir", str(run), "--model-dir", str(src),
                 "--out", str(tmp_path / "hf")]) == 0


def test_export_checks_options_and_checkpoint_before_reading_weights(ms_cpu, tmp_path, tiny_hf_dir, capsys):
    """issue 19.4: --shard-size abc was a raw int() error; a truncated checkpoint a SafetensorError traceback."""
    from finetune.export import main

    src = tiny_hf_dir()
    path, _, _ = _checkpoint(ms_cpu, tmp_path, src)
    args = ["--checkpoint", "latest", "--output-dir", str(tmp_path / "run"), "--model-dir", str(src)]
    assert main(args + ["--shard-size", "abc"]) == 2
    assert "--shard-size 'abc'" in capsys.readouterr().err
    weights = path / "model_rank00000.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main(args) == 2
    err = capsys.readouterr().err
    assert str(weights) in err and "truncated" in err and "older checkpoint" in err
    assert not (tmp_path / "run" / "hf-step_00000007").exists()


def test_export_imports_no_mindspore():
    code = "import sys, finetune.export; sys.exit(int('mindspore' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


@pytest.mark.parametrize("vocab_parallel,family", [(False, {}), (True, {}),
                                                   (True, {"model_type": "qwen3", "head_dim": 16})])
def test_tp1_checkpoint_resumes_under_tp2_and_dp2(ms_cpu, tmp_path, tiny_hf_dir, vocab_parallel, family):
    """Each TP rank gets its slice of the weights and moments; a sharded DP rank its bucket chunks
    (Qwen3: its replicated q/k norms whole on every rank)."""
    from finetune.io.checkpoint import load_checkpoint

    ms = ms_cpu
    src = tiny_hf_dir(tie_word_embeddings=False, num_key_value_heads=1, **family)  # tp=2 > 1 KV head: replicated
    path, ref, moments = _checkpoint(ms, tmp_path, src)
    full = {p.name: p.asnumpy() for p in ref.trainable_params()}
    for r in range(2):
        rank = RankInfo(rank=r, world_size=2, tp=2, tp_rank=r, tp_group="tp")
        model = _model(ms, src, rank, vocab_parallel=vocab_parallel)
        state, optim = load_checkpoint(path, model.trainable_params(), rank, False)
        assert state.step == 7 and int(optim["t"]) == 7
        assert any(p.name.endswith("k_norm.weight") for p in model.trainable_params()) == bool(family)
        for p in model.trainable_params():
            part, want, m = model.tp_layout.get(p.name), full[p.name], moments[f"m.{p.name}"]
            if part is not None:
                index = [slice(None)] * want.ndim
                index[part.axis] = slice(part.start, part.start + part.size)
                want, m = want[tuple(index)], m[tuple(index)]
            np.testing.assert_array_equal(p.asnumpy(), want, err_msg=p.name)
            np.testing.assert_array_equal(optim[f"m.{p.name}"], m, err_msg=p.name)
        assert ("model.embed_tokens.weight" in model.tp_layout) == vocab_parallel
    chunks = []
    for r in range(2):  # tp 1 x dp 2, sharded: the two ranks' chunks of each bucket are the flat moments
        rank = RankInfo(rank=r, world_size=2, dp=2, dp_rank=r, dp_group="dp")
        model = _model(ms, src, rank)
        _, optim = load_checkpoint(path, model.trainable_params(), rank, shard=True)
        assert list(optim["shard.layout"][:2]) == [2, r]
        chunks.append([optim[f"shard.v.{k}"] for k in range(int(optim["shard.layout"][3]))])
    flat = np.concatenate([moments[f"v.{p.name}"].reshape(-1) for p in ref.trainable_params()])
    joined = np.concatenate([c for pair in zip(*chunks) for c in pair])
    np.testing.assert_array_equal(joined[:flat.size], flat)
    assert not joined[flat.size:].any()  # the last chunk's padding


def test_latest_falls_back_past_a_truncated_newest_checkpoint(ms_cpu, tmp_path, tiny_hf_dir, capsys):
    """Issue 31: ``export --checkpoint latest`` on a truncated newest checkpoint stopped instead of taking the one
    before, as resume does; it now names the skipped one and exports the older."""
    from finetune.export import main
    from finetune.io.checkpoint import TrainerState, save_checkpoint

    src = tiny_hf_dir()
    path, model, moments = _checkpoint(ms_cpu, tmp_path, src)
    newer = save_checkpoint(tmp_path / "run" / "checkpoints", TrainerState(9, {}, {"scale": 1.0, "good_steps": 0}, 0),
                            model.trainable_params(), {"t": np.array(9, np.int64), **moments}, RankInfo(), keep=2)
    weights = newer / "model_rank00000.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main(["--checkpoint", "latest", "--output-dir", str(tmp_path / "run"), "--model-dir", str(src)]) == 0
    err = capsys.readouterr().err
    assert f"skipping {weights}" in err and "truncated" in err and "latest: step_00000007" in err
    assert (tmp_path / "run" / "hf-step_00000007" / "config.json").is_file()
