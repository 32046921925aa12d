"""Tensor parallelism (tp=2) under msrun on CPU: same logits, loss, gradients and export as tp=1.

Cases: the embedding and LM head replicated (untied), vocab-parallel with the parallel
cross-entropy (untied, and tied with the loss over chunks of 5 tokens), and replicated KV heads
(tp > num_key_value_heads); Qwen3 untied and tied vocab-parallel (its q/k norm weights' gradients are
summed over the TP ranks, each of which normalizes only its heads).

Gradients of replicated KV heads (tp > num_key_value_heads) are partial per rank and must be summed
over the ranks sharing a head; that reduction belongs to the training step and is not checked here.
"""
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
from safetensors.numpy import load_file

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden"

WORKER = TP2_WORKER_HEAD + r'''
from finetune.dist import RankInfo
from finetune.io.hf_io import export_hf, gather_full, load_hf_config, load_weights
from finetune.model.decoder import ModelConfig, DecoderLM
''' + TP2_WORKER_INIT + r'''
rank = RankInfo(rank=get_rank(), world_size=2, tp=2, tp_rank=get_rank(), tp_group="tp")
out_dir = sys.argv[2]
g = np.load(sys.argv[3])
ids, labels = g["input_ids"].astype(np.int32), g["labels"].astype(np.int32)
pos = np.tile(np.arange(ids.shape[1], dtype=np.int32), (ids.shape[0], 1))
args = [ms.Tensor(x) for x in (ids, labels, pos, np.ones_like(ids))]
for case, (model_dir, vocab_parallel, chunk) in json.loads(sys.argv[4]).items():
    model = DecoderLM(ModelConfig.from_dict(load_hf_config(model_dir)), rank, vocab_parallel=vocab_parallel,
                             loss_chunk_tokens=chunk)
    load_weights(model, model_dir)
    logits = model.logits(args[0]).asnumpy()
    full = {"loss": model(*args).asnumpy()}
    if case != "kv1":  # gradients too (KV heads split, not replicated: every slice is complete)
        params = model.trainable_params()
        loss, grads = ms.value_and_grad(lambda *a: model(*a), None, params)(*args)
        full.update({"grad/" + p.name: gather_full(model, p.name, gr, rank) for p, gr in zip(params, grads)})
    export_hf(model, model_dir, f"{out_dir}/export-{case}", dtype="fp32", shard_size_bytes=10**9, rank=rank)
    if rank.is_main:
        np.savez(f"{out_dir}/{case}.npz", logits=logits, **full)
'''


@pytest.mark.slow
def test_tp2_matches_single_process(ms_cpu, tmp_path, tiny_hf_dir):
    ms = ms_cpu
    msrun = Path(sys.executable).parent / "msrun"
    if not msrun.exists() or not shutil.which("ip"):
        pytest.skip("msrun (mindspore) or iproute2 missing")
    replicated = tiny_hf_dir("kv1", vocab_size=256, num_key_value_heads=1)  # tp=2 > 1 KV head: replicated
    # [model dir, vocab_parallel, loss_chunk_tokens]: the tied vocab-parallel loss over chunks of 5 tokens
    cases = {"untied": [str(GOLDEN / "untied"), False, 0], "untied-vp": [str(GOLDEN / "untied"), True, 0],
             "tied-vp": [str(GOLDEN / "tied"), True, 5], "kv1": [str(replicated), False, 0],
             "qwen3-untied": [str(GOLDEN / "qwen3-untied"), False, 0],
             "qwen3-tied-vp": [str(GOLDEN / "qwen3-tied"), True, 5]}
    (tmp_path / "worker.py").write_text(WORKER)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    cmd = [str(msrun), "--worker_num", "2", "--local_worker_num", "2", "--master_port", str(free_port()),
           "--join", "True", "--log_dir", str(tmp_path / "logs"), str(tmp_path / "worker.py"), str(REPO),
           str(tmp_path), str(GOLDEN / "untied" / "golden.npz"), json.dumps(cases)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((tmp_path / "logs").glob("*.log")))
    assert proc.returncode == 0, proc.stdout[-2000:] + logs

    for case, golden in (("untied", "untied"), ("untied-vp", "untied"), ("tied-vp", "tied"),
                         ("qwen3-untied", "qwen3-untied"), ("qwen3-tied-vp", "qwen3-tied")):
        g = np.load(GOLDEN / golden / "golden.npz")  # transformers' numbers for the same inputs
        n = int((g["labels"][:, 1:] != -100).sum())
        tp = np.load(tmp_path / f"{case}.npz")
        np.testing.assert_allclose(tp["logits"], g["logits"], atol=1e-4, err_msg=case)
        np.testing.assert_allclose(float(tp["loss"]) / n, float(g["loss"]), rtol=1e-5, err_msg=case)
        grads = [k for k in g.files if k.startswith("grad/")]
        assert grads and set(grads) <= set(tp.files), case
        for key in grads:
            np.testing.assert_allclose(tp[key] / n, g[key], rtol=1e-4, atol=1e-5, err_msg=f"{case}: {key}")

    # replicated KV heads: same logits and loss as this process's tp=1 run of the same weights
    from finetune.io.hf_io import load_hf_config, load_weights
    from finetune.model.decoder import DecoderLM, ModelConfig

    model = DecoderLM(ModelConfig.from_dict(load_hf_config(replicated)))
    load_weights(model, replicated)
    ids, labels = g["input_ids"].astype(np.int32), g["labels"].astype(np.int32)
    pos = np.tile(np.arange(ids.shape[1], dtype=np.int32), (ids.shape[0], 1))
    kv1 = np.load(tmp_path / "kv1.npz")
    np.testing.assert_allclose(kv1["logits"], model.logits(ms.Tensor(ids)).asnumpy(), atol=1e-5)
    loss = model(*(ms.Tensor(x) for x in (ids, labels, pos, np.ones_like(ids))))
    np.testing.assert_allclose(kv1["loss"], loss.asnumpy(), rtol=1e-5)

    # export gathers the TP slices back into the original tensors
    for case, (src, _, _) in cases.items():
        original = load_file(str(Path(src) / "model.safetensors"))
        exported = load_file(str(tmp_path / f"export-{case}" / "model.safetensors"))
        assert exported.keys() == original.keys()
        for name, value in original.items():
            np.testing.assert_array_equal(exported[name], value, err_msg=f"{case}: {name}")


CHECK_WORKER = TP2_WORKER_HEAD + r'''
from jobspec.config import ExportConfig, Recipe
from jobspec.rundir import RunDir
from finetune.dist import RankInfo
from finetune.generate import sample_check
from finetune.io.hf_io import export_hf, load_hf_config, load_weights
from finetune.model.decoder import ModelConfig, DecoderLM
''' + TP2_WORKER_INIT + r'''
rank = RankInfo(rank=get_rank(), world_size=2, tp=2, tp_rank=get_rank(), tp_group="tp")
model_dir, out = sys.argv[2], sys.argv[3]
model = DecoderLM(ModelConfig.from_dict(load_hf_config(model_dir)), rank, vocab_parallel=True)
load_weights(model, model_dir)
hf = f"{out}/hf"
export_hf(model, model_dir, hf, dtype="fp32", rank=rank)
# as run/loop.py does: tokenizer and generation config from the base model, which every rank has
# (rank 0 alone writes the export; reading it from rank 1 races with that write)
sample_check(model, model_dir, Recipe(export=ExportConfig(check_max_new_tokens=4)), rank, RunDir(out).samples)
'''


@pytest.mark.slow
def test_inference_check_under_tp2_equals_one_process(ms_cpu, tmp_path, tiny_hf_dir):
    """Both TP ranks generate in step (same logits, same draws); rank 0 writes what one process writes."""
    from finetune.dist import RankInfo
    from finetune.generate import load_model, sample_check
    from jobspec.config import ExportConfig, Recipe

    msrun = Path(sys.executable).parent / "msrun"
    if not msrun.exists() or not shutil.which("ip"):
        pytest.skip("msrun (mindspore) or iproute2 missing")
    src = tiny_hf_dir(vocab_size=151936)  # the real tokenizer's ids
    (tmp_path / "check_worker.py").write_text(CHECK_WORKER)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    cmd = [str(msrun), "--worker_num", "2", "--local_worker_num", "2", "--master_port", str(free_port()),
           "--join", "True", "--log_dir", str(tmp_path / "logs"), str(tmp_path / "check_worker.py"), str(REPO),
           str(src), str(tmp_path / "tp2")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((tmp_path / "logs").glob("*.log")))
    assert proc.returncode == 0, proc.stdout[-2000:] + logs
    model, _, _ = load_model(src, "cpu")
    (tmp_path / "one").mkdir()
    one = sample_check(model, tmp_path / "tp2" / "hf", Recipe(export=ExportConfig(check_max_new_tokens=4)), RankInfo(),
                       tmp_path / "one" / "samples.jsonl")
    got = (tmp_path / "tp2" / "samples.jsonl").read_text(encoding="utf-8")
    assert got == one.read_text(encoding="utf-8") and len(got.splitlines()) == 5
