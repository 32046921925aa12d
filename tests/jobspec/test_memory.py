"""Memory estimator: exact tensor byte counts per layout, and the field guide's 7B figure."""
import math
from pathlib import Path

import pytest

from jobspec.memory import PHASES, estimate_memory, shard_elements
from jobspec.model_layout import local_shapes

QWEN7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
              num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)


def _count(cfg, **kw):
    return sum(math.prod(s) for s in local_shapes(cfg, **kw).values())


def test_qwen7b_parameter_count_is_the_published_one():
    assert _count(QWEN7B) == 7_615_616_512


def test_qwen7b_tp2_dp2_sharded_counts_every_buffer_of_the_backward_peak():
    """Issue 30: bf16 weights and one micro-batch's bf16 gradients (2 + 2 bytes / tp), the fp32 accumulator
    (4 / tp), fp32 masters and moments (12 / (tp*dp)) per parameter, then activations, logits, workspace; and
    the fp32 cast of the largest gradient (the 76,032 x 3,584 embedding shard's) as it is added into the
    accumulator (GradReduction._add; the layers run op by op on the NPU, so the overlap's hooks add in place)."""
    from jobspec.config import TrainConfig

    est = estimate_memory(QWEN7B, seq_len=4096, micro_batch_size=1, tp=2, dp=2, precision="bf16", recompute=True,
                          shard_optimizer=True, vocab_parallel=True, loss_chunk_tokens=TrainConfig().loss_chunk_tokens,
                          grad_accum=8)
    state = est.weights + est.grads + est.accumulator + est.master + est.optimizer
    assert abs(state - 7_615_616_512 * (8 / 2 + 12 / 4) - 76_032 * 3_584 * 4) / state < 1e-3
    assert est.peak_phase == "backward" and est.total == state + est.activations + est.logits + est.workspace + \
        est.collectives
    assert "total" in est.table() and "GiB" in est.table() and "accumulator" in est.summary()
    assert est.step_peak == est.total  # no save term on an NPU: a step's peak is the run's


def test_the_step_peak_leaves_out_the_checkpoint_save():
    """tools/bench_memory.py checks step 1 (no save) against static + max(backward, step), the run against total:
    in host memory a save's copies come on top of the step's peak (MindSpore's pool keeps its blocks)."""
    from jobspec.memory import MemoryEstimate

    est = MemoryEstimate(weights=4, grads=2, master=0, optimizer=8, activations=1, workspace=1, totals=3, update=1,
                         staging=30)
    assert est.step_peak == 4 + 8 + 1 + max(2 + 1, 3 + 1) and est.total == est.step_peak + 30
    assert MemoryEstimate.from_parts({**est.parts(), "staging": 0}).total == est.step_peak


def test_a_cpu_save_comes_on_top_of_the_pools_part_of_the_backward_with_the_logits_only_where_mindspore_holds_them():
    """In fp32 the host GEMM's logits are numpy's, returned when freed; in fp16 they are MindSpore's, kept by its
    pool, so a save's copies come on top of them (measured: make bench-memory's h256-fp16-ga4, docs/memory.md)."""
    base = dict(seq_len=256, micro_batch_size=1, loss_chunk_tokens=1024, device="cpu", grad_accum=4)
    cfg = {**TINY, "tie_word_embeddings": False}
    fp32, fp16 = (estimate_memory(cfg, **base, precision=p) for p in ("fp32", "fp16"))
    rows = 151936 * 64 * 4  # the untied embedding's gradient, whole in numpy at the step's last micro-batch (fp32)
    assert fp32.host_backward == fp32.logits + rows and fp16.host_backward == rows and fp16.logits > 0
    assert fp32.host_step == rows and fp16.host_step == rows
    for est in (fp32, fp16):
        phases = est.phases()
        host = max(phases["backward"] + est.host_apart - est.host_backward, phases["step"] - est.host_step)
        assert phases["save"] == est.staging + host
    assert estimate_memory(cfg, **{**base, "device": "npu"}, precision="fp32").host_backward == 0


def test_a_trained_tied_embedding_counts_its_gradient_buffers_beyond_grads():
    """On Ascend and vocab-parallel, the LM head's d weight and the lookup's dense one, [vocab, hidden] fp32 each,
    in the backward; on the host with the whole vocabulary one buffer, the gradient itself (TiedGradient): nothing
    in fp32; none untied, none under LoRA (the embedding is frozen); 4 bytes more per element in bf16."""
    from jobspec.lora_config import LoraConfig

    base = dict(seq_len=256, micro_batch_size=1, precision="fp32", loss_chunk_tokens=1024, device="cpu")
    rows = 151936 * 64
    assert estimate_memory(TINY, **base).tied == 0
    assert estimate_memory(TINY, **{**base, "precision": "bf16"}).tied == rows * 4
    split = estimate_memory(TINY, **{**base, "tp": 2, "vocab_parallel": True})
    assert split.tied == rows // 2 * 2 * 4 and split.peak_phase == "backward"
    phases = split.phases()  # a save keeps the pool's part of the backward: not the numpy logits and head d weight
    assert phases["save"] == phases["backward"] - split.logits - split.tied // 2 + split.staging
    assert estimate_memory({**TINY, "tie_word_embeddings": False}, **base).tied == 0
    assert estimate_memory(TINY, **base, lora=LoraConfig()).tied == 0
    # the host's one buffer is the gradient in grads, the accumulator (grad_accum > 1) and the totals, in numpy:
    # a save's copies come on top of the pool's part only (measured: make bench-memory's h1024 rows, docs/memory.md)
    assert split.host_step == 0 and estimate_memory(TINY, **{**base, "device": "npu"}).host_step == 0
    for grad_accum, buffers in ((1, 1), (4, 2)):
        whole = estimate_memory(TINY, **base, grad_accum=grad_accum)
        assert whole.host_backward == whole.logits + buffers * rows * 4 and whole.tied == 0
        assert whole.host_step == rows * 4
        phases = whole.phases()
        assert phases["save"] == whole.staging + max(phases["backward"] - whole.logits - buffers * rows * 4,
                                                     phases["step"] - rows * 4)
    assert estimate_memory(TINY, **{**base, "precision": "bf16", "device": "npu"}).tied == 3 * rows * 4
    assert estimate_memory(TINY, **{**base, "device": "npu"}).tied == 2 * rows * 4


def test_an_untied_embeddings_gradient_accumulates_as_its_rows_on_the_host():
    """CPU, fp32 or fp16, the whole vocabulary, untied (parallel/vocab.py RowGradient): with grad_accum > 1 the
    accumulator holds the step's looked-up rows (and a merge's two more) in place of the embedding's [vocab, hidden]
    fp32 buffer; its whole gradient is numpy's, in fp32, in the last (or only) micro-batch's grads and the totals
    (host_backward, host_step). Not in bf16 (numpy has none), tied, vocab-parallel, under ZeRO-2 or on the NPU."""
    cfg = {**TINY, "tie_word_embeddings": False}
    base = dict(seq_len=256, micro_batch_size=2, precision="fp32", loss_chunk_tokens=1024, device="cpu",
                recompute=False)
    emb, rows = 151936 * 64 * 4, 2 * 4 * 512 * 64 * 4  # grad_accum 4 x 512 tokens, the union and the new rows
    four = estimate_memory(cfg, **base, grad_accum=4)
    assert four.accumulator == 4 * _count(cfg) - emb + rows
    assert four.host_backward == four.logits + emb and four.host_step == emb
    one = estimate_memory(cfg, **base)
    assert one.accumulator == 0 and one.host_backward == one.logits + emb and one.host_step == emb
    for est in (one, four):  # the numpy logits are freed before the lookup's backward makes the numpy gradient
        assert est.host_apart == min(est.logits, emb) > 0
        backward = sum(getattr(est, t) for t in PHASES["backward"])
        assert est.phases()["backward"] == backward - est.host_apart
        assert est.phases()["save"] == est.staging + max(backward - est.host_backward, est.phases()["step"] - emb)
    fp16 = estimate_memory(cfg, **{**base, "precision": "fp16"}, grad_accum=4)
    assert fp16.accumulator == 4 * _count(cfg) - emb + rows  # the LM head's fp32 cast: after the backward, under
    assert fp16.grads == 2 * _count(cfg) + emb // 2 and fp16.host_backward == fp16.host_step == emb  # its logits
    cast = 151936 * 64 * 4  # the LM head's fp32 cast while it is added (the embedding's needs none)
    small = estimate_memory(cfg, **{**base, "precision": "fp16", "loss_chunk_tokens": 8}, grad_accum=4)
    assert small.logits < cast and small.accumulator == 4 * _count(cfg) - emb + rows + cast - small.logits
    dp2 = estimate_memory(cfg, **{**base, "precision": "fp16", "dp": 2}, grad_accum=4)  # the hooks cast in the
    assert dp2.accumulator == 4 * _count(cfg) - emb + rows + cast  # backward, beside the logits
    for other in ({"precision": "bf16"}, {"device": "npu"}, {"tp": 2, "vocab_parallel": True},
                  {"dp": 2, "shard_optimizer": True, "zero": 2}):
        est = estimate_memory(cfg, **{**base, **other}, grad_accum=4)
        assert est.host_step == 0 == est.host_apart, other
        if "zero" not in other:
            assert est.accumulator >= 4 * _count(cfg, **({"tp": 2, "vocab_parallel": True} if "tp" in other else {}))
    tied = estimate_memory(TINY, **base, grad_accum=4)
    assert tied.accumulator == 4 * _count(TINY)


def test_one_micro_batch_in_low_precision_casts_its_fp32_totals_in_the_backward_only_under_dp():
    """One DP rank casts the compute-dtype gradients to the fp32 totals after the backward (GradReduction.finish,
    each dropped as it is cast): the step's totals, not an accumulator on top of the logits (measured: make
    bench-memory's h256-fp16-ga1, docs/memory.md); DP's overlapped hooks cast them in the backward (but the
    embedding's, fp32 from its rows on the host: h256-fp16-dp2-ga1)."""
    cfg = {**TINY, "tie_word_embeddings": False}
    base = dict(seq_len=256, micro_batch_size=1, precision="fp16", loss_chunk_tokens=1024, device="cpu")
    one = estimate_memory(cfg, **base)
    assert one.accumulator == 0 and one.totals == 4 * _count(cfg)
    emb = 151936 * 64 * 4  # the lookup's rows make the embedding's gradient in fp32: its own total
    assert estimate_memory(cfg, **base, dp=2).accumulator == 4 * _count(cfg) - emb
    assert estimate_memory(cfg, **{**base, "device": "npu"}, dp=2).accumulator == 4 * _count(cfg)
    four = estimate_memory(cfg, **base, grad_accum=4).accumulator  # all but the embedding (its rows: below)
    assert 4 * (_count(cfg) - 151936 * 64) < four < 4 * _count(cfg)


def test_the_estimate_grows_with_what_grows():
    base = dict(seq_len=1024, micro_batch_size=1, tp=1, dp=1, precision="fp32", loss_chunk_tokens=1024,
                device="cpu", recompute=False)
    one = estimate_memory(TINY, **base)
    assert one.accumulator == 0  # fp32, one micro-batch: the gradients are the totals
    four = estimate_memory(TINY, **{**base, "grad_accum": 4})
    assert four.accumulator == 4 * _count(TINY) and four.total > one.total
    assert estimate_memory(TINY, **{**base, "grad_accum": 8}) == four  # nothing grows beyond the accumulator
    mb2, long = estimate_memory(TINY, **{**base, "micro_batch_size": 2}), estimate_memory(TINY, **{**base,
                                                                                                 "seq_len": 2048})
    assert mb2.activations == 2 * one.activations == long.activations
    dp2 = estimate_memory(TINY, **{**base, "dp": 2})
    sharded = estimate_memory(TINY, **{**base, "dp": 2, "shard_optimizer": True})
    assert dp2.collectives > 0 and sharded.optimizer < dp2.optimizer and sharded.staging < dp2.staging
    from jobspec.lora_config import LoraConfig

    lora = estimate_memory(TINY, **base, lora=LoraConfig())
    assert lora.optimizer < one.optimizer / 100 and lora.activations > one.activations  # the dropout inputs
    npu = estimate_memory(TINY, **{**base, "device": "npu"})
    assert npu.staging == 0 and npu.workspace > one.workspace  # staging is host memory


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_split_rules(tp):
    shapes = local_shapes(TINY, tp=tp)
    hd = 64 // 4
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (4 // tp * hd, 64)
    kv = (2 // tp if tp <= 2 else 1) * hd  # tp=4 > 2 kv heads: one head per rank, replicated
    assert shapes["model.layers.1.self_attn.k_proj.bias"] == (kv,)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (64, 176 // tp)
    assert shapes["model.embed_tokens.weight"] == (151936, 64) and "lm_head.weight" not in shapes
    assert local_shapes(TINY, tp=tp, vocab_parallel=True)["model.embed_tokens.weight"] == (151936 // tp, 64)


def test_bad_tp_names_the_key():
    with pytest.raises(ValueError, match="parallel.tp=3"):
        local_shapes(TINY, tp=3)


def test_shard_elements_partition_every_bucket():
    assert shard_elements(10, 2, bucket_bytes=16) == 2 + 2 + 1  # buckets of 4,4,2 elements
    assert shard_elements(1000, 1) == 1000


@pytest.mark.parametrize("tp,dp,shard,precision,vp", [
    (1, 1, False, "fp32", True), (2, 1, False, "fp32", True), (2, 1, False, "fp32", False), (1, 2, True, "fp32", True),
    (2, 2, True, "bf16", True), (4, 2, True, "fp32", True), (2, 2, False, "bf16", False)])
def test_state_parts_equal_real_tensor_bytes_on_every_rank(tp, dp, shard, precision, vp):
    """The model built for each TP rank (a RankInfo without collectives) and the optimizer for each
    DP rank hold exactly the bytes the estimator predicts; tp=4 > 2 KV heads replicates them;
    vp: vocab-parallel embedding and LM head (1/tp of the rows each) or replicated."""
    ms = pytest.importorskip("mindspore")
    from finetune.dist import RankInfo
    from finetune.model.decoder import DecoderLM, ModelConfig
    from finetune.run.training import build_optimizer
    from jobspec.config import TrainConfig
    from jobspec.tiny import TINY_DEFAULTS

    cfg = dict(TINY_DEFAULTS, vocab_size=1024, tie_word_embeddings=False)  # small vocab: fast, untied head
    est = estimate_memory(cfg, seq_len=64, micro_batch_size=1, tp=tp, dp=dp, precision=precision,
                          shard_optimizer=shard, vocab_parallel=vp)
    dtype = {"fp32": ms.float32, "bf16": ms.bfloat16}[precision]
    for r in range(tp * dp):
        rank = RankInfo(rank=r, world_size=tp * dp, tp=tp, dp=dp, tp_rank=r % tp, dp_rank=r // tp,
                        tp_group="tp" if tp > 1 else None, dp_group="dp" if dp > 1 else None)
        params = DecoderLM(ModelConfig.from_dict(cfg), rank, vocab_parallel=vp).trainable_params()
        for p in params:
            p.set_dtype(dtype)  # (set_data(p.astype(...)) would keep the fp32 dtype)
        assert sum(int(p.nbytes) for p in params) == est.weights
        assert sum(int(p.nbytes) for p in params) == est.grads  # one micro-batch's, in the compute dtype
        assert sum(4 * math.prod(p.shape) for p in params) == est.accumulator or precision == "fp32"
        opt = build_optimizer(params, TrainConfig(), rank, shard=shard)
        state = sum(int(v.nbytes) for k, v in opt.state_dict().items() if k not in ("t", "shard.layout"))
        assert state == est.master + est.optimizer, (r, state, est)


# ---------------------------------------------------------------------------- layout choice (issue 21)

def test_tp_is_the_smallest_that_fits_and_says_why():
    from jobspec.layout_choice import choose_layout
    from jobspec.qwen_sizes import SIZES

    q7, q32 = SIZES["Qwen2.5-7B"], SIZES["Qwen2.5-32B"]
    c = choose_layout(q7, 4, seq_len=4096)
    # TP 2 ZeRO-1 misses by the accumulator's fp32 cast of the 76,032 x 3,584 embedding shard's gradient (1.0 GiB)
    assert (c.tp, c.dp, c.zero) == (4, 1, 1) and c.why == ("TP 4: TP 1 ZeRO-1 needs 85.1 GiB per NPU > 54 planned; "
                                                           "TP 2 ZeRO-1 needs 54.4 GiB per NPU > 54 planned")
    c = choose_layout(q7, 8, seq_len=4096)  # the recipes' grad_accum 8: bf16 gradients and the fp32 accumulator
    assert (c.tp, c.dp) == (2, 4) and c.why.startswith("TP 2 ZeRO-1: TP 1 ZeRO-1 needs 74.5 GiB per NPU > 54 planned")
    assert c.estimate is not None and c.estimate.peak_phase == "backward" and c.estimate.accumulator > 0
    c = choose_layout(q7, 16, seq_len=4096)  # the optimizer sharded over 16: TP 1 still needs the accumulator
    assert (c.tp, c.dp) == (2, 8) and "TP 1 ZeRO-1 needs 69.1 GiB per NPU > 54 planned" in c.why
    assert choose_layout(q32, 16, seq_len=4096, stages=(1,)).tp is None
    c = choose_layout(q32, 32, seq_len=4096)
    assert (c.tp, c.dp, c.zero) == (8, 4, 1) and "TP 4 ZeRO-1 needs 78.1 GiB per NPU > 54 planned" in c.why
    assert choose_layout(q32, 32, seq_len=4096, npus_per_node=4, stages=(1,)).tp is None  # TP stays in a node
    assert choose_layout(SIZES["Qwen3-32B"], 32, seq_len=4096).tp == 8
    assert choose_layout(SIZES["Qwen3-8B"], 8, seq_len=4096).why.startswith("TP 2 ZeRO-1: TP 1 ZeRO-1 needs 80.0 GiB")


def test_the_lowest_stage_that_fits_then_the_smallest_tp():
    """32B on 16 NPUs: no TP fits with ZeRO-1, TP 8 with ZeRO-2 (its fp32 gradient sums sharded, the reduce-scatters
    in flight bounded); 72B on 32 only with ZeRO-3, whose terms are the decoder layers' shard and one gathered
    layer, the embedding and LM head whole."""
    from jobspec.layout_choice import choose_layout
    from jobspec.memory import BUCKET_BYTES, IN_FLIGHT_BUCKETS, estimate_memory
    from jobspec.qwen_sizes import SIZES

    q32, q72 = SIZES["Qwen2.5-32B"], SIZES["Qwen2.5-72B"]
    c = choose_layout(q32, 16, seq_len=4096)
    assert (c.tp, c.dp, c.zero) == (8, 2, 2) and "TP 8 ZeRO-1 needs 58.3 GiB per NPU > 54 planned; TP 1 ZeRO-2" in c.why
    c = choose_layout(q72, 32, seq_len=4096)
    assert (c.tp, c.dp, c.zero) == (2, 16, 3)
    assert "TP 8 ZeRO-2 needs 74.9 GiB per NPU > 54 planned; TP 1 ZeRO-3" in c.why

    def est(zero):
        return estimate_memory(q72, seq_len=4096, micro_batch_size=1, tp=2, dp=16, grad_accum=8, vocab_parallel=True,
                               shard_optimizer=True, zero=zero)

    one, two, three = est(1), est(2), est(3)
    assert two.accumulator == 0 and two.grad_shards == one.totals and two.rs_buckets == IN_FLIGHT_BUCKETS * BUCKET_BYTES
    assert two.weights == one.weights and two.grads == one.grads
    head = 2 * (152064 // 2) * 8192 + 8192  # embedding and LM head (vocab-parallel), final norm: whole
    layer = (one.weights // 2 - head) // 80
    assert three.gathered == 2 * layer and three.grads == 2 * (layer + head)
    assert three.weights == pytest.approx(2 * (80 * layer / 16 + head), rel=1e-3) and three.accumulator == 0
    assert three.gather_buffer == 2 * (layer + 2 * BUCKET_BYTES // 4)


def test_a_zero3_save_streams_one_layer_on_the_device_and_every_layer_on_the_writing_ranks_host():
    """ZeRO-3's checkpoint save and export (parallel/zero3.py ShardedWeights.on_host): the device holds one gathered
    layer and its gather buckets (72B at TP 2 x DP 16: below the backward, so the plan's
    total is unchanged: test_plan_zero.py); the writing rank's host copies of every layer count on CPU only, where
    the host is the device."""
    from jobspec.memory import PHASES, estimate_memory, layer_elements
    from jobspec.qwen_sizes import SIZES

    q72 = SIZES["Qwen2.5-72B"]
    npu = estimate_memory(q72, seq_len=4096, micro_batch_size=1, tp=2, dp=16, grad_accum=8, vocab_parallel=True,
                          shard_optimizer=True, zero=3)
    assert PHASES["save"] == ("staging", "gathered", "gather_buffer", "host_layers")  # the loop dropped the totals
    assert npu.phases()["save"] == npu.gathered + npu.gather_buffer and npu.host_layers == 0
    assert npu.phases()["save"] < npu.phases()["backward"] and npu.peak_phase == "backward"
    cpu = estimate_memory(TINY, seq_len=64, micro_batch_size=1, dp=2, precision="fp32", shard_optimizer=True,
                          zero=3, device="cpu")
    assert cpu.host_layers == 4 * sum(layer_elements(local_shapes(TINY, 1))) > 0
    one = estimate_memory(TINY, seq_len=64, micro_batch_size=1, dp=2, precision="fp32", shard_optimizer=True,
                          zero=1, device="cpu")
    assert one.host_layers == one.gathered == 0


def test_per_step_traffic_of_each_stage():
    from jobspec.layout_choice import dp_link, step_traffic

    n, d, a = 1000, 4, 8
    sent = {z: step_traffic(z, weights=n, trained=n, dp=d, grad_accum=a, nbytes=2) for z in (0, 1, 2, 3)}
    assert sent == {0: 6000, 1: 4500, 2: 25500, 3: 48000}  # 3/4 of 8n, 6n, (32 + 2)n, 32n + 32n
    assert step_traffic(3, weights=n, trained=n, dp=1, grad_accum=a, nbytes=2) == 0
    # the embedding / LM head whole: gathered once after the step, not twice per micro-batch
    kept = step_traffic(3, weights=n, trained=n, dp=d, grad_accum=a, nbytes=2, whole=100)
    assert kept == (32 * n + 32 * 900 + 2 * 100) * 3 // 4
    assert dp_link(8, 4, 8) == "RoCE between 4 nodes" and dp_link(2, 4, 8) == "HCCS inside a node"
    assert dp_link(2, 8, 8) == "RoCE between 2 nodes"


def test_a_layout_that_fits_nowhere_names_the_smallest_world_and_its_layout():
    from jobspec.layout_choice import no_fit_advice
    from jobspec.qwen_sizes import SIZES

    msg = no_fit_advice(SIZES["Qwen2.5-32B"], 8, seq_len=4096)
    assert msg.startswith("no layout of 8 NPU(s) fits: TP 1 ZeRO-1 needs") and "16 NPUs (2 node(s), TP 8 x DP 2, " \
        "ZeRO-2)" in msg
    assert "data.seq_len=" not in msg and "LoRA" in msg  # no sequence of >= 256 fits 32B on 8 NPUs
    msg = no_fit_advice(SIZES["Qwen2.5-7B"], 2, seq_len=4096)
    assert "TP 2 needs" in msg and "4 NPUs (1 node(s), TP 4 x DP 1)" in msg
    msg = no_fit_advice(SIZES["Qwen2.5-7B"], 4, seq_len=131072)  # activations: a shorter sequence fits
    assert "data.seq_len=32768" in msg
    msg = no_fit_advice(SIZES["Qwen2.5-72B"], 8, seq_len=4096, stages=(1, 2))  # parallel.zero=2 given
    assert "would fit: 128 NPUs (16 node(s), TP 8 x DP 16, ZeRO-2)" in msg
    msg = no_fit_advice(SIZES["Qwen2.5-72B"], 8, seq_len=4096, stages=(1,))  # the replicated fp32 gradients
    assert "no layout on up to 256 NPUs with ZeRO-1" in msg and "node(s)" not in msg


def test_qwen3_estimate_counts_its_own_shapes():
    from jobspec.memory import estimate_memory
    from jobspec.model_layout import param_count
    from jobspec.qwen_sizes import SIZES

    q3 = SIZES["Qwen3-0.6B"]  # head_dim 128 with hidden 1024 / 16 heads: q_proj is 2048 x 1024
    h, i, n, v, hd = 1024, 3072, 28, 151936, 128  # per layer: 2 norms, q/k/v/o, q_norm + k_norm, MLP; tied
    assert param_count(q3) == v * h + n * (2 * h + 16 * hd * h + 2 * 8 * hd * h + h * 16 * hd + 2 * hd + 3 * h * i) + h
    qwen2_shaped = {**q3, "model_type": "qwen2", "head_dim": 64}
    a = estimate_memory(q3, seq_len=4096, micro_batch_size=1)
    assert a.weights == 2 * param_count(q3) and a.total > estimate_memory(qwen2_shaped, seq_len=4096,
                                                                          micro_batch_size=1).total


def test_the_sizes_page_table_is_the_estimators():
    from jobspec.qwen_sizes import size_table

    page = (Path(__file__).resolve().parents[2] / "docs" / "sizes.md").read_text()
    table = page.split("<!-- size-table:begin -->\n", 1)[1].split("\n<!-- size-table:end -->", 1)[0]
    assert table == size_table()
    assert "| Qwen2.5-72B | full | 72.71 B | TP 2 x DP 16, ZeRO-3 | 32 | 4 |" in table
    assert "| Qwen2.5-32B | full | 32.76 B | TP 8 x DP 2, ZeRO-2 | 16 | 2 |" in table
    assert "| Qwen2.5-7B | full | 7.62 B | TP 4 x DP 1 | 4 | 1 |" in table
    assert "| Qwen2.5-72B | LoRA | 72.71 B | TP 4 x DP 1 | 4 | 1 |" in table


def test_the_readme_headline_sizes_are_the_estimators():
    """README.md's short size table: Qwen2.5-7B on one 8-NPU node as choose_layout plans it, then rows of
    docs/sizes.md's table without their `why` column; the README links that page."""
    from jobspec.layout_choice import choose_layout
    from jobspec.qwen_sizes import SIZES, TABLE_SEQ_LEN, size_table

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| Qwen")]
    one_node = choose_layout(SIZES["Qwen2.5-7B"], 8, seq_len=TABLE_SEQ_LEN)
    assert one_node.estimate is not None
    gib = one_node.estimate.total / 2**30
    assert rows[0] == f"| Qwen2.5-7B | full | 7.62 B | {one_node.label} | 8 | 1 | {gib:.1f} |"
    full = size_table().splitlines()
    assert len(rows) == 3 and all(any(f.startswith(row + " ") for f in full) for row in rows[1:]), rows
    assert "(docs/sizes.md)" in readme


def test_the_table_is_what_plan_estimates_for_the_chosen_layout():
    """plan's estimate (the NPU recipe resolved with the chosen TP on that world) equals the table's."""
    from jobspec.layout_choice import smallest_world
    from jobspec.memory import memory_estimate
    from jobspec.qwen_sizes import SIZES
    from jobspec.recipe_load import load_recipe

    for name in ("Qwen2.5-7B", "Qwen3-14B"):  # ZeRO-1 rows (a ZeRO-3 row: tests/launcher/test_plan_zero.py)
        world, choice = smallest_world(SIZES[name], seq_len=4096)
        recipe = load_recipe("qwen2.5-7b-full", {"parallel.tp": str(choice.tp)}).resolved(world, "npu")
        assert memory_estimate(recipe, SIZES[name]).total == choice.estimate.total, name


@pytest.mark.parametrize("recipe,over", [("qwen-full", {}), ("qwen-lora", {}),
                                         ("qwen-full", {"train.recompute": "false", "train.micro_batch_size": "2",
                                                        "parallel.vocab_parallel": "false"})])
def test_auto_tp_estimates_the_recipe_as_it_will_be_resolved(recipe, over):
    """TrainShape.of(recipe) (what parallel.tp: auto estimates) == memory_estimate of the resolved recipe."""
    from jobspec.memory import TrainShape, memory_estimate
    from jobspec.qwen_sizes import SIZES
    from jobspec.recipe_load import load_recipe

    cfg, shape = SIZES["Qwen3-8B"], TrainShape.of(load_recipe(recipe, over), "npu")
    for tp, world in ((1, 8), (2, 8), (4, 16)):
        resolved = load_recipe(recipe, {**over, "parallel.tp": str(tp)}).resolved(world, "npu")
        assert shape.estimate(cfg, tp, world // tp, 4096) == memory_estimate(resolved, cfg), (tp, world)


def test_compiled_layer_graphs_count_on_cpu_only_and_grow_with_layers_tokens_width_and_sequence():
    """train.compile_layers: each decoder layer's graph holds buffers beyond op by op (measured, docs/memory.md);
    a CPU term (the layers run op by op on Ascend), growing with the layers, the micro-batch's tokens, the width,
    the rows' length (the attention scores); under LoRA the frozen base's weights count nothing."""
    from jobspec.lora_config import LoraConfig
    from jobspec.memory import GRAPH_BYTES, graph_bytes

    base = dict(seq_len=256, micro_batch_size=1, precision="fp32", recompute=False, device="cpu")
    off, on = estimate_memory(TINY, **base), estimate_memory(TINY, **base, compile_layers=True)
    assert off.graphs == 0 and on.graphs == graph_bytes(TINY, 256, 256) > 2 * GRAPH_BYTES
    assert on.step_peak - off.step_peak == on.total - off.total == on.graphs and "graphs" in on.summary()
    assert "graphs" not in off.summary()
    assert estimate_memory(TINY, **{**base, "device": "npu"}, compile_layers=True).graphs == 0
    deeper = {**TINY, "num_hidden_layers": 4}
    wider = {**TINY, "hidden_size": 128, "num_attention_heads": 2}
    assert graph_bytes(deeper, 256, 256) == 2 * graph_bytes(TINY, 256, 256)
    assert graph_bytes(TINY, 512, 256) > graph_bytes(TINY, 256, 256)
    assert graph_bytes(wider, 256, 256) > graph_bytes(TINY, 256, 256)
    assert graph_bytes(TINY, 512, 512) > graph_bytes(TINY, 512, 256)  # the same tokens in longer rows
    lora = estimate_memory(TINY, **base, compile_layers=True, lora=LoraConfig())
    assert lora.graphs == graph_bytes(TINY, 256, 256, lora=True) < on.graphs


def test_zero3_with_lora_shards_the_frozen_base_and_the_adapters():
    """LoRA ZeRO-3 (finetune/parallel/zero3_lora.py): each rank keeps 1/dp of the frozen base's layers (bf16) and
    of the fp32 adapters, gathers one layer's base and the adapters' buckets at a time; the adapters' gradients only."""
    from jobspec.lora_config import LoraConfig, trainable_elements
    from jobspec.memory import BUCKET_BYTES, estimate_memory
    from jobspec.qwen_sizes import SIZES

    q72, lora = SIZES["Qwen2.5-72B"], LoraConfig()

    def est(zero):
        return estimate_memory(q72, seq_len=4096, micro_batch_size=1, tp=2, dp=16, grad_accum=8, vocab_parallel=True,
                               shard_optimizer=True, zero=zero, lora=lora)

    one, three = est(1), est(3)
    adapters, _ = trainable_elements(q72, lora, 2, True)
    head = 2 * (152064 // 2) * 8192 + 8192
    layer = ((one.weights - 4 * adapters) // 2 - head) // 80
    assert three.weights == pytest.approx(2 * (80 * layer / 16 + head) + 4 * adapters / 16, rel=1e-3)
    assert three.grads == one.grads and three.gathered == 2 * layer
    assert three.gather_buffer == 2 * layer + 4 * min(adapters, 2 * BUCKET_BYTES // 4)
    assert three.total < one.total - 0.8 * 2 * 80 * layer
