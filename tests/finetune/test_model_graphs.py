"""Decoder layers compiled as graphs (DecoderModel.compile_layers) compute what the op-by-op path does."""
from __future__ import annotations

from pathlib import Path

import numpy as np

GOLDEN = Path(__file__).resolve().parent / "golden"


def test_compiled_layers_match_transformers(ms_cpu):
    ms = ms_cpu
    from finetune.io.hf_io import load_hf_config, load_weights
    from finetune.model.decoder import DecoderLM, ModelConfig

    g = np.load(GOLDEN / "untied" / "golden.npz")
    model = DecoderLM(ModelConfig.from_dict(load_hf_config(GOLDEN / "untied")))
    load_weights(model, GOLDEN / "untied")
    model.model.compile_layers()
    assert len(model.model.graphs) == 2
    ids, labels = g["input_ids"].astype(np.int32), g["labels"].astype(np.int32)
    pos = np.tile(np.arange(ids.shape[1], dtype=np.int32), (ids.shape[0], 1))
    np.testing.assert_allclose(model.logits(ms.Tensor(ids)).asnumpy(), g["logits"], atol=1e-4, rtol=0)
    params = model.trainable_params()
    loss, grads = ms.value_and_grad(lambda *a: model(*a), None, params)(
        *(ms.Tensor(x) for x in (ids, labels, pos, np.ones_like(ids))))
    n = int((labels[:, 1:] != -100).sum())
    np.testing.assert_allclose(float(loss.asnumpy()) / n, float(g["loss"]), rtol=1e-5)
    by_name = {p.name: gr.asnumpy() / n for p, gr in zip(params, grads)}
    for key in (k for k in g.files if k.startswith("grad/")):
        np.testing.assert_allclose(by_name[key[5:]], g[key], rtol=1e-4, atol=1e-5, err_msg=key)


def test_a_compiled_layer_sees_weights_written_in_place_and_not_new_storage(ms_cpu):
    """Why every writer of a weight writes in place (optim.update.write_param's Tensor.copy_, the CPU host
    kernel through own_memory): a compiled layer reads the weight's memory, so it sees those writes as the
    op-by-op layer does, but not a weight given new storage by Parameter.set_data (before its first call
    only: hf_io and checkpoint restore run before the first step)."""
    ms = ms_cpu
    from finetune.hostmem import own_memory
    from finetune.model.decoder import DecoderLM, ModelConfig
    from finetune.optim.update import write_param

    cfg = ModelConfig.from_dict({"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                 "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False})
    ids = ms.Tensor(np.random.default_rng(0).integers(0, 128, (1, 8)).astype(np.int32))
    writers = {"write_param": lambda w, x: write_param(w, ms.Tensor(x)),
               "host kernel": lambda w, x: own_memory(w).__setitem__(slice(None), x),
               "set_data": lambda w, x: w.set_data(ms.Tensor(x))}
    changed = {}
    for compiled in (False, True):
        model = DecoderLM(cfg)
        if compiled:
            model.model.compile_layers()
        w = next(p for p in model.trainable_params() if "layers.0.mlp.down_proj" in p.name)
        for i, (name, write) in enumerate(writers.items()):
            before = model.logits(ids).asnumpy()
            write(w, np.full(w.shape, 0.1 * (i + 1), np.float32))
            changed[compiled, name] = not np.allclose(model.logits(ids).asnumpy(), before)
    assert changed == {(False, "write_param"): True, (False, "host kernel"): True, (False, "set_data"): True,
                       (True, "write_param"): True, (True, "host kernel"): True, (True, "set_data"): False}
