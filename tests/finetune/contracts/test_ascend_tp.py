"""The Ascend path at tp=2 under msrun on CPU, the fused ops replaced by their contract twins in
both workers: fp32 equals the transformers goldens (replicated and vocab-parallel LM head), and
fp16 packed rows (TND flash attention with the per-rank heads) equal the single-process result."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from msrun_helpers import TP2_WORKER_HEAD, TP2_WORKER_INIT, free_port

from tests.finetune.contracts.test_ascend_path import ASCEND, HD16, _packed_batch

REPO = Path(__file__).resolve().parents[3]
GOLDEN = REPO / "tests" / "finetune" / "golden"

WORKER = TP2_WORKER_HEAD + r'''
from finetune.dist import RankInfo
from finetune.io.hf_io import gather_full, load_hf_config, load_weights
from finetune.model.decoder import ModelConfig, DecoderLM
from tests.finetune.contracts.twins import install
''' + TP2_WORKER_INIT + r'''
calls = install()
rank = RankInfo(rank=get_rank(), world_size=2, tp=2, tp_rank=get_rank(), tp_group="tp", device_target="Ascend")
out_dir = sys.argv[2]
for case, (model_dir, vocab_parallel, dtype, batch) in json.loads(sys.argv[3]).items():
    b = np.load(batch)
    ids, labels, pos, seg = (b[k].astype(np.int32) for k in ("ids", "labels", "pos", "seg"))
    model = DecoderLM(ModelConfig.from_dict(load_hf_config(model_dir)), rank, vocab_parallel=vocab_parallel,
                             compute_dtype=getattr(ms, dtype))
    load_weights(model, model_dir)
    params = model.trainable_params()
    if dtype != "float32":
        for p in params:
            p.set_dtype(getattr(ms, dtype))
    args = [ms.Tensor(x) for x in (ids, labels, pos, seg)]
    logits = model.logits(args[0], args[2], args[3]).asnumpy().astype(np.float32)
    loss, grads = ms.value_and_grad(lambda *a: model(*a), None, params)(*args)
    full = {"grad/" + p.name: gather_full(model, p.name, gr, rank) for p, gr in zip(params, grads)}
    if rank.is_main:
        np.savez(f"{out_dir}/{case}.npz", logits=logits, loss=loss.asnumpy(), calls=json.dumps(calls), **full)
'''


def _hd16_dir(path: Path) -> Path:
    """The HD16 model as a Hugging Face directory (seeded weights, std 0.1)."""
    from safetensors.numpy import save_file

    from jobspec.tiny import random_weights

    path.mkdir()
    (path / "config.json").write_text(json.dumps({**HD16, "model_type": "qwen2", "tie_word_embeddings": False}))
    save_file(random_weights(HD16, seed=11, std=0.1), str(path / "model.safetensors"))
    return path


@pytest.mark.slow
def test_tp2_ascend_path_under_twins(ms_cpu, tmp_path):
    ms = ms_cpu
    msrun = Path(sys.executable).parent / "msrun"
    if not msrun.exists() or not shutil.which("ip"):
        pytest.skip("msrun (mindspore) or iproute2 missing")
    g = np.load(GOLDEN / "untied" / "golden.npz")
    ids = g["input_ids"].astype(np.int32)
    np.savez(tmp_path / "golden-batch.npz", ids=ids, labels=g["labels"],
             pos=np.tile(np.arange(ids.shape[1]), (ids.shape[0], 1)), seg=np.ones_like(ids))
    np.savez(tmp_path / "packed-batch.npz", **dict(zip(("ids", "labels", "pos", "seg"), _packed_batch())))
    hd16 = _hd16_dir(tmp_path / "hd16")
    cases = {"untied": [str(GOLDEN / "untied"), False, "float32", str(tmp_path / "golden-batch.npz")],
             "untied-vp": [str(GOLDEN / "untied"), True, "float32", str(tmp_path / "golden-batch.npz")],
             "hd16-fp16": [str(hd16), True, "float16", str(tmp_path / "packed-batch.npz")]}
    (tmp_path / "worker.py").write_text(WORKER)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    cmd = [str(msrun), "--worker_num", "2", "--local_worker_num", "2", "--master_port", str(free_port()),
           "--join", "True", "--log_dir", str(tmp_path / "logs"), str(tmp_path / "worker.py"), str(REPO),
           str(tmp_path), json.dumps(cases)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((tmp_path / "logs").glob("*.log")))
    assert proc.returncode == 0, proc.stdout[-2000:] + logs

    n = int((g["labels"][:, 1:] != -100).sum())
    for case in ("untied", "untied-vp"):
        tp = np.load(tmp_path / f"{case}.npz")
        np.testing.assert_allclose(tp["logits"], g["logits"], atol=1e-4, err_msg=case)
        np.testing.assert_allclose(float(tp["loss"]) / n, float(g["loss"]), rtol=1e-5, err_msg=case)
        for key in (k for k in g.files if k.startswith("grad/")):
            np.testing.assert_allclose(tp[key] / n, g[key], rtol=1e-4, atol=1e-5, err_msg=f"{case}: {key}")

    # fp16 packed rows: tp=2 (2 query / 1 KV head per rank in TND) = the single-process Ascend path
    from finetune.io.hf_io import load_hf_config, load_weights
    from finetune.model.decoder import DecoderLM, ModelConfig
    from tests.finetune.contracts.twins import install

    with pytest.MonkeyPatch.context() as mp:
        install(mp.setattr)
        model = DecoderLM(ModelConfig.from_dict(load_hf_config(hd16)), ASCEND, compute_dtype=ms.float16)
        load_weights(model, hd16)
        for p in model.trainable_params():
            p.set_dtype(ms.float16)
        batch = _packed_batch()
        one = model.logits(*(ms.Tensor(batch[i]) for i in (0, 2, 3))).asnumpy().astype(np.float32)
        loss = float(model(*(ms.Tensor(x) for x in batch)).asnumpy())
    tp = np.load(tmp_path / "hd16-fp16.npz")
    calls = json.loads(str(tp["calls"]))
    assert calls["flash_attention_score"] >= 2 and calls["rms_norm"] and calls["swiglu"]
    np.testing.assert_allclose(tp["logits"], one, atol=3e-2 * np.abs(one).max())
    np.testing.assert_allclose(float(tp["loss"]), loss, rtol=3e-2)
