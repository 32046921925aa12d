"""What each term of the memory estimate is (``TERMS``: the code that allocates it) and the setting that shrinks it
(``SHRINKS``); ``jobspec.memory`` computes them, the plan prints them, the worker's step-1 warning names them."""
from __future__ import annotations

# Which code allocates each term (the plan prints the terms; docs/memory.md measures them).
TERMS = {
    "weights": "the model's parameters in the compute dtype, LoRA adapters in fp32 (finetune/model/decoder.py)",
    "master": "fp32 master weights (optim/adamw.py AdamW.master, optim/sharded.py master chunks)",
    "optimizer": "Adam moments m and v in fp32 (optim/adamw.py, optim/sharded.py: this rank's shard)",
    "accumulator": "fp32 gradient accumulator over micro-batches (parallel/overlap.py GradReduction.add), and the "
                   "largest tensor's fp32 temporaries while it is added (GradReduction._add, _arrive)",
    "grads": "one micro-batch's gradients in the compute dtype (run/loop.py accumulate: grad_fn's output)",
    "activations": "kept activations (recompute: the layer inputs and one layer's; LoRA dropout inputs)",
    "logits": "the LM head's logits chunk and its gradient (parallel/vocab.py LMHeadCrossEntropy)",
    "tied": "a trained tied embedding's [vocab, hidden] gradient buffers beyond grads: the LM head's d weight "
            "(LMHeadCrossEntropy.bprop) and the lookup's dense one before autodiff sums them; on the host, one "
            "buffer (parallel/vocab.py TiedGradient)",
    "host_backward": "not a term of its own: the backward phase's bytes held in numpy on the host, returned when "
                     "freed, so no part of what a save's copies come on top of (MemoryEstimate.phases): the LM "
                     "head's fp32 logits (LMHeadCrossEntropy's host GEMM; in fp16/bf16 they are MindSpore's, kept by "
                     "its pool), a trained tied embedding's gradient in grads and the accumulator (TiedGradient), an "
                     "untied one's whole gradient in the step's last micro-batch's grads (RowGradient)",
    "host_apart": "not a term of its own: of host_backward, the bytes never alive together, so counted once less in "
                  "the backward: the LM head's fp32 logits (freed by its backward) and an untied embedding's whole "
                  "gradient (made by the backward's last op, the lookup's: RowGradient); the smaller of the two",
    "host_step": "not a term of its own: the step phase's totals held in numpy on the host (the tied or untied "
                 "embedding's gradient above)",
    "totals": "the DP-reduced fp32 gradients the optimizer reads, this rank's chunks when sharded "
              "(GradReduction.finish; CPU DP: the shared-memory sums, new arrays)",
    "update": "optimizer update temporaries over the largest tensor or bucket chunk: its clipped gradient and the "
              "kernel's (optim/update.py StepGate.update)",
    "collectives": "DP reduction buffers: a bucket's flat copy in flight (NPU), the shared-memory regions "
                   "(CPU, hostcomm.py Slots: host_slot_bytes)",
    "staging": "checkpoint-save host copies (io/checkpoint.py save_checkpoint; host memory: CPU only)",
    "workspace": "framework workspace beyond the tensors (NPU: runtime, HCCL, fragmentation; CPU: measured)",
    "graphs": "the compiled decoder-layer graphs' own buffers (CPU, train.compile_layers: finetune/model/decoder.py)",
    # ZeRO-2 and 3 (parallel.zero; docs/distributed.md "ZeRO stages")
    "grad_shards": "ZeRO-2/3: this rank's fp32 chunk sums of the earlier micro-batches' gradients "
                   "(parallel/overlap.py ShardedAccumulation.add)",
    "rs_buckets": "ZeRO-2/3: reduce-scatter inputs in flight, each bucket's flat fp32 copy (transport.py _flat, "
                  "kept by collectives.InFlight until waited: at most IN_FLIGHT_BUCKETS, ShardedAccumulation._launch)",
    "gathered": "ZeRO-3: the gathered decoder layer's compute-dtype weights, one layer at a time "
                "(parallel/zero3.py ShardedWeights.use)",
    "gather_buffer": "ZeRO-3: one layer's all-gather buckets: that layer's until they are copied into its weights, "
                     "then, while it computes, the next layer's, started early (ShardedWeights._put, the prefetch)",
    "host_layers": "ZeRO-3: the whole decoder layers' host copies the rank writing a checkpoint or export keeps "
                   "(parallel/zero3.py ShardedWeights.on_host; host memory: CPU only)",
}
# The setting that shrinks each term (the worker's step-1 warning names it with the largest term).
SHRINKS = {
    "weights": "a larger parallel.tp, or train.method=lora",
    "master": "parallel.shard_optimizer=true over more DP ranks, or a larger parallel.tp",
    "optimizer": "parallel.shard_optimizer=true over more DP ranks, or a larger parallel.tp",
    "accumulator": "a larger parallel.tp (or train.grad_accum=1 with a larger train.micro_batch_size)",
    "grads": "a larger parallel.tp, or train.method=lora",
    "activations": "train.recompute=true, or a smaller train.micro_batch_size or data.seq_len",
    "logits": "a smaller train.loss_chunk_tokens, or parallel.vocab_parallel=true with TP",
    "tied": "parallel.vocab_parallel=true with a larger parallel.tp (or train.method=lora)",
    "host_backward": "a smaller train.loss_chunk_tokens, or parallel.vocab_parallel=true with TP",
    "host_step": "parallel.vocab_parallel=true with a larger parallel.tp",
    "host_apart": "nothing (it lowers the estimate)",
    "totals": "parallel.shard_optimizer=true",
    "update": "parallel.shard_optimizer=true",
    "collectives": "parallel.host_collectives=false (CPU)",
    "staging": "parallel.shard_optimizer=true (each rank stages its shard)",
    "workspace": "nothing in the recipe (the framework's)",
    "graphs": "train.compile_layers=false (op by op, slower)",
    "grad_shards": "more DP ranks, or a larger parallel.tp",
    "rs_buckets": "nothing in the recipe (IN_FLIGHT_BUCKETS buckets of about 25 MB)",
    "gathered": "a larger parallel.tp",
    "gather_buffer": "a larger parallel.tp",
    "host_layers": "a larger parallel.tp",
}
