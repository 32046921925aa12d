"""Per-device memory estimate for a full or LoRA fine-tune (pure Python; the launcher imports it).

Every buffer alive at the step's peak, each term tied to the code that allocates it. Weights, gradients,
fp32 master weights and Adam moments are exact element counts of the local tensors under the layout (the
TP split rules of ``jobspec.model_layout``, which the model uses too; the same bucket partition as the
sharded optimizer). Activations and workspace are an estimate. A step has three peaks, the largest counts
(:attr:`MemoryEstimate.total`): the backward (accumulator, one micro-batch's gradients, activations,
logits), the optimizer step (fp32 totals, update temporaries, collective buffers) and a checkpoint save
(staging), each on top of weights, masters, moments and workspace.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from jobspec.config import Recipe, TrainConfig
from jobspec.lora_config import LoraConfig, trainable_elements
from jobspec.memory_terms import TERMS
from jobspec.model_layout import Dims, local_kv_heads, local_shapes
from jobspec.platform import PLATFORMS
from jobspec.shard_layout import ShardLayout

BUCKET_BYTES = 25 * 2**20  # gradient/optimizer collective bucket (about 25 MB): finetune.dist uses it
# ZeRO-2/3: reduce-scatters a rank keeps in flight during the backward, each holding its bucket's flat fp32 copy
# (parallel/overlap.py ShardedAccumulation._launch waits for the oldest first)
IN_FLIGHT_BUCKETS = 2
# CPU DP through shared memory: regions per member and set of buckets (finetune/hostcomm.py Slots), each of the
# largest bucket, reused in turn: 2, so that one bucket is posted while the previous one is read
HOST_REGIONS = 2

WORKSPACE_BYTES = 1_500_000_000  # NPU: the framework's workspace, HCCL buffers, allocator fragmentation
# CPU: what a training process holds beyond an empty MindSpore process (same imports, same device setup) and the
# tensors counted: the token cache, the tokenizer, thread pools, and freed heap that glibc keeps (the launcher's
# malloc settings) but a later buffer does not fit in; measured by tools/bench_memory.py (docs/memory.md)
CPU_WORKSPACE_BYTES = 200 * 2**20
# CPU, train.compile_layers: what each compiled decoder layer (finetune/model/decoder.py compile_layers) holds
# beyond op by op, measured per layer by tools/bench_graphs.py (compiled - op by op, 2 and 4 layers, the steady
# pass) and fitted over 8 full fine-tune shapes (hidden 256-1024, 256-1024 tokens, sequence 256-512), each within
# 5 %, LoRA's 3 within 10 % (docs/memory.md): per layer, per fp32 byte of its weights (not under LoRA: the frozen
# base has no weight gradient), per token x hidden of the micro-batch, per token x head x position (the scores)
GRAPH_BYTES, GRAPH_PER_WEIGHT_BYTE, GRAPH_PER_TOKEN_HIDDEN, GRAPH_PER_SCORE = 20_400_000, 1.53, 471, 44
_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# a checkpoint is saved after the update, the step's totals dropped (run/loop.py train_loop); in host memory (CPU)
# on top of what the step's peak left resident (MemoryEstimate.phases); ZeRO-3 streams the layers to the writing
# rank's host through one gathered layer at a time
PHASES = {"backward": ("accumulator", "grads", "activations", "logits", "tied", "grad_shards", "rs_buckets", "gathered",
                      "gather_buffer"), "step": ("totals", "update"),
          "save": ("staging", "gathered", "gather_buffer", "host_layers")}
STATIC = ("weights", "master", "optimizer", "collectives", "workspace", "graphs")


@dataclass
class MemoryEstimate:
    """Bytes per device, by term (:data:`TERMS`); the total counts the largest phase (:data:`PHASES`)."""

    weights: int
    grads: int
    master: int
    optimizer: int
    activations: int
    workspace: int
    accumulator: int = 0
    logits: int = 0
    tied: int = 0
    host_backward: int = 0  # counted in the backward's terms, not again (TERMS)
    host_step: int = 0  # counted in totals, not again (TERMS)
    host_apart: int = 0  # of host_backward: never alive together, counted once less (TERMS)
    totals: int = 0
    update: int = 0
    collectives: int = 0
    staging: int = 0
    graphs: int = 0
    grad_shards: int = 0
    rs_buckets: int = 0
    gathered: int = 0
    gather_buffer: int = 0
    host_layers: int = 0

    def phases(self) -> dict[str, int]:
        """Bytes of each phase on top of the static terms. A save's host copies (``staging``, CPU only) come on top
        of what the step's peak left resident: MindSpore's CPU memory pool keeps the blocks it grew to, while the
        numpy arrays of the backward and the step (``host_backward``, ``host_step``: the LM head's fp32 logits, the
        embedding's gradient where it is built on the host, ``parallel/vocab.py``) are mapped on their own and
        returned when freed (the launcher's malloc settings, docs/memory.md "glibc"); so the backward's numpy logits
        and the embedding's numpy gradient, never alive together, hold the same pages in turn (``host_apart``)."""
        out = {k: sum(getattr(self, t) for t in terms) for k, terms in PHASES.items()}
        out["backward"] -= self.host_apart
        if self.staging:
            pool = out["backward"] - (self.host_backward - self.host_apart) - self.tied // 2
            out["save"] += max(pool, out["step"] - self.host_step)
        return out

    @property
    def peak_phase(self) -> str:
        phases = self.phases()
        return max(phases, key=phases.__getitem__)

    @property
    def total(self) -> int:
        return int(sum(getattr(self, t) for t in STATIC)) + max(self.phases().values())

    @property
    def step_peak(self) -> int:
        """The static terms + the larger of backward and step: a step without a checkpoint save (step 1's peak)."""
        phases = self.phases()
        return int(sum(getattr(self, t) for t in STATIC)) + max(phases["backward"], phases["step"])

    def parts(self) -> dict[str, int]:
        """Every term in bytes, in :data:`TERMS` order."""
        return {f.name: getattr(self, f.name) for f in sorted(fields(self), key=lambda f: list(TERMS).index(f.name))}

    def largest(self) -> str:
        """The largest term counted in the total."""
        counted = [*STATIC, *PHASES[self.peak_phase]]
        return max(counted, key=lambda t: getattr(self, t))

    @classmethod
    def from_parts(cls, parts: dict[str, Any]) -> MemoryEstimate:
        """The estimate from :meth:`parts` (plan.json's ``memory``; keys it does not know are left out)."""
        return cls(**{f.name: int(parts.get(f.name, 0)) for f in fields(cls)})

    def summary(self) -> str:
        """One line in GiB: the static terms + the largest phase, each phase with its terms."""
        def terms(names: tuple[str, ...]) -> str:
            return " + ".join(f"{t} {getattr(self, t) / 2**30:.1f}" for t in names)
        phases = " | ".join(f"{k}{' (peak)' if k == self.peak_phase else ''}: {terms(v)}" for k, v in PHASES.items())
        static = tuple(t for t in STATIC if t != "graphs" or self.graphs)  # graphs: CPU only
        return f"{terms(static)} + max({phases}) = {self.total / 2**30:.1f}"

    def table(self) -> str:
        peak = set(PHASES[self.peak_phase])
        head = f"{'part':<13}{'GB':>9}{'GiB':>9}  counted"
        rows = [f"{k:<13}{v / 1e9:9.2f}{v / 2**30:9.2f}  {'yes' if k in STATIC or k in peak else 'no'}"
                for k, v in self.parts().items()]
        return "\n".join([head, *rows, f"{'total':<13}{self.total / 1e9:9.2f}{self.total / 2**30:9.2f}  "
                                        f"(peak: {self.peak_phase})"])


def shard_elements(total: int, dp: int, bucket_bytes: int = BUCKET_BYTES) -> int:
    """fp32 elements one DP rank holds in the sharded optimizer (its chunk of every padded bucket)."""
    return sum(ShardLayout((total,), dp, bucket_bytes).chunks)


def layer_elements(local: dict[str, tuple[int, ...]]) -> list[int]:
    """Elements of each decoder layer of one TP rank: what ZeRO-3 shards and gathers, one layer at a time (the
    embedding, final norm and LM head stay whole: ``finetune/parallel/zero3.py``)."""
    layers: dict[str, int] = {}
    for name, shape in local.items():
        parts = name.split(".")
        if parts[1:2] == ["layers"]:
            layers[parts[2]] = layers.get(parts[2], 0) + math.prod(shape)
    return list(layers.values())


@dataclass(frozen=True)
class ZeroTerms:
    """The terms a ZeRO stage changes or adds (bytes per device; :data:`TERMS`)."""

    weights: int
    grads: int
    accumulator: int
    grad_shards: int = 0
    rs_buckets: int = 0
    gathered: int = 0
    gather_buffer: int = 0
    host_layers: int = 0


def zero_terms(stage: int, *, n: int, adapters: int, grads: int, accumulator: int, trained: int, state: int,
               layers: list[int], nbytes: int, dp: int, grad_accum: int, device: str, lora: bool) -> ZeroTerms:
    """Stage 0/1: the weights (``n`` elements in the compute dtype, ``adapters`` in fp32), ``grads`` and
    ``accumulator`` as given. 2: the fp32 accumulator becomes this rank's chunk sums (``state`` elements; with
    grad_accum > 1) and the reduce-scatters in flight hold IN_FLIGHT_BUCKETS flat fp32 buckets (NPU; on CPU
    the shared-memory slots, ``collectives``, hold them). 3: as 2, and the decoder layers' compute-dtype
    weights are this rank's chunks; one layer is gathered at a time (for its forward, again for its recomputed
    backward): its weights, one layer's gather buckets (the layer and the two buckets it may straddle: its own
    until they are copied into its weights, then the next layer's, prefetched while it computes: two layers in
    all) and, in the backward, its weight gradients beside the whole embedding's / LM head's
    (``finetune/parallel/zero3.py``).
    With ``lora`` the sharded weights are the fp32 adapters and the frozen base's layers are cut layer by layer
    (``zero3_lora.FrozenShards``): the gather's flat buffers are one layer's base and the adapters' buckets.
    A checkpoint save or export streams the layers the same way, the writing rank keeping them on its host (on CPU,
    where the host is the device, they count)."""
    whole = n * nbytes + adapters * 4
    if stage < 2:
        return ZeroTerms(whole, grads, accumulator)
    shards = state * 4 if grad_accum > 1 else 0
    flats = min(trained * 4, IN_FLIGHT_BUCKETS * BUCKET_BYTES) if not PLATFORMS[device].host_memory else 0
    if stage == 2:
        return ZeroTerms(whole, grads, 0, shards, flats)
    in_layers, unit = sum(layers), max(layers)
    other = n - in_layers
    held = in_layers * nbytes + adapters * 4 if PLATFORMS[device].host_memory else 0
    if lora:
        weights = (shard_elements(in_layers, dp) + other) * nbytes + shard_elements(adapters, dp) * 4
        buffer = unit * nbytes + min(adapters, 2 * BUCKET_BYTES // 4) * 4
        return ZeroTerms(weights, grads, 0, shards, flats, unit * nbytes, buffer, held)
    weights = (shard_elements(in_layers, dp) + other) * nbytes
    buffer = min(in_layers, unit + 2 * BUCKET_BYTES // 4) * nbytes
    return ZeroTerms(weights, (unit + other) * nbytes, 0, shards, flats, unit * nbytes, buffer, held)


def host_slot_bytes(bucket: int, dp: int, sharded: bool, nbytes: int) -> int:
    """CPU DP through shared memory (``finetune/hostcomm.py``): what one rank's RSS holds of the ``Slots``, kept
    across steps: ``HOST_REGIONS`` regions per member, each of the largest bucket (``bucket`` fp32 elements), reused
    bucket after bucket. A mapped page counts in the RSS of every member that touches it. Unsharded (a sum): its
    own regions and every peer's, read whole (dp x 4 B per element). Sharded (a reduce-scatter of chunks ``c`` =
    bucket / dp): its regions but its chunk, each peer's chunk of theirs ((dp - 1) x c), its kept chunk apart
    (``Slots.kept``); the weights' all-gather regions: its chunk and every peer's, in the weights' dtype
    (``nbytes``). The sums are new arrays, the totals the optimizer reads (``totals``)."""
    if not sharded:
        return HOST_REGIONS * dp * bucket * 4
    c = -(-bucket // dp)
    return HOST_REGIONS * ((c * dp + (dp - 1) * c) * 4 + dp * c * nbytes)


def tied_bytes(model_config: dict[str, Any], rows: int, precision: str, in_place: bool) -> int:
    """A trained tied embedding's gradient buffers beyond ``grads`` (the ``tied`` term; ``rows`` x hidden elements,
    fp32: a tied embedding stays fp32). ``in_place`` (host memory, the whole vocabulary on the rank:
    ``parallel/vocab.py`` TiedGradient): the LM head's d weight is the weight's gradient, the lookup's rows added
    into it, so in fp32 nothing beyond ``grads``. Otherwise (Ascend, vocab-parallel) autodiff sums the head's and
    the lookup's dense d weights into a third: two fp32 copies more. In bf16/fp16 4 bytes more per element either
    way: the head's compute-dtype d weight before its fp32 cast, and the fp32 gradient's bytes beyond the compute
    dtype ``grads`` counts."""
    if not model_config.get("tie_word_embeddings"):
        return 0
    per_element = (0 if in_place else 8) + (0 if precision == "fp32" else 4)
    return rows * int(model_config["hidden_size"]) * per_element


def _layer_activation_elems(cfg: dict[str, Any], tp: int) -> int:
    """Activation elements per token that one layer keeps for backward (flash attention)."""
    d = Dims.of(cfg)
    replicated = 5 * d.hidden  # norm inputs/outputs and the residual
    heads = d.heads // tp
    split = 2 * (heads + 2 * local_kv_heads(cfg, tp)) * d.head_dim + 2 * heads * d.head_dim + 4 * (d.inter // tp)
    return replicated + split


def layer_weight_elements(model_config: dict[str, Any]) -> int:
    """Elements of one decoder layer's weights (the whole layer, tp 1)."""
    return sum(math.prod(s) for n, s in local_shapes(model_config, 1).items() if ".layers.0." in n)


def graph_bytes(model_config: dict[str, Any], tokens: int, seq_len: int, lora: bool = False) -> int:
    """The compiled layer graphs' buffers on CPU (train.compile_layers) at ``tokens`` per micro-batch of
    ``seq_len``-token rows (fp32); ``lora``: the frozen base's weights count nothing."""
    d = Dims.of(model_config)
    weights = 0 if lora else GRAPH_PER_WEIGHT_BYTE * 4 * layer_weight_elements(model_config)
    per_layer = GRAPH_BYTES + weights + GRAPH_PER_TOKEN_HIDDEN * tokens * d.hidden + GRAPH_PER_SCORE * tokens * \
        d.heads * seq_len
    return d.layers * math.ceil(per_layer)


def estimate_memory(model_config: dict[str, Any], *, seq_len: int, micro_batch_size: int, tp: int = 1, dp: int = 1,
                    precision: str = "bf16", recompute: bool = True, shard_optimizer: bool = False,
                    vocab_parallel: bool = False, loss_chunk_tokens: int = 0, grad_accum: int = 1,
                    lora: LoraConfig | None = None, device: str = "npu", zero: int = 1,
                    compile_layers: bool = False) -> MemoryEstimate:
    """Predict bytes per device from a Hugging Face Qwen2 config dict and the layout. ``lora`` (a
    LoraConfig, train.method=lora): the base is frozen in the compute dtype; only the fp32 adapters
    (and modules_to_save, with fp32 masters) have gradients and optimizer state. ``device`` 'cpu': the
    host is the device (checkpoint staging counts, the measured CPU workspace, the compiled layer graphs
    with ``compile_layers``: never on Ascend, where the layers run op by op). ``zero``: the ZeRO stage
    (1-3) when the optimizer is sharded over dp > 1 (:func:`zero_terms`)."""
    if precision not in _DTYPE_BYTES:
        raise ValueError(f"train.precision={precision!r}: one of bf16, fp16, fp32 for the estimate")
    nbytes = _DTYPE_BYTES[precision]
    local = local_shapes(model_config, tp, vocab_parallel)
    sizes = [math.prod(s) for s in local.values()]
    n = sum(sizes)
    adapters, saved = trainable_elements(model_config, lora, tp, vocab_parallel) if lora else (0, n)
    trained = adapters + saved
    sharded = shard_optimizer and dp > 1
    state = shard_elements(trained, dp) if sharded else trained
    # fp32 params are their own master; adapters always are
    master = (shard_elements(saved, dp) if sharded else saved) * 4 if precision != "fp32" else 0
    tokens = seq_len * micro_batch_size
    h, layers, vocab = model_config["hidden_size"], model_config["num_hidden_layers"], model_config["vocab_size"]
    per_layer = _layer_activation_elems(model_config, tp) * tokens * nbytes
    acts = layers * tokens * h * nbytes + per_layer if recompute else layers * per_layer
    if lora is not None and lora.dropout > 0:  # each adapter keeps its dropped input (column: whole, row: split)
        d = Dims.of(model_config)
        inputs = 5 * d.hidden + (d.heads * d.head_dim + d.inter) // tp
        acts += (layers if not recompute else 1) * tokens * inputs * nbytes
    head_tokens = min(tokens, loss_chunk_tokens) if loss_chunk_tokens > 0 else tokens
    # three fp32 buffers (logits, exponentials, softmax - onehot) and the compute-dtype copy of the gradient; on
    # CPU in fp32 with the whole vocabulary, one: numpy writes softmax - onehot over the kept logits
    host = PLATFORMS[device].host_memory
    host_softmax = host and precision == "fp32" and not (vocab_parallel and tp > 1)
    head_rows = vocab // tp if vocab_parallel else vocab
    logits = head_tokens * head_rows * (4 if host_softmax else 3 * 4 + nbytes)
    # fp32 totals: with one micro-batch the micro-batch's own gradients in fp32: in fp32 they are the totals; in
    # bf16/fp16 one DP rank casts them after the backward, each dropped as it is cast (GradReduction.finish), into
    # what the logits and activations freed (the step's totals), while DP's overlapped hooks cast them in the
    # backward. With grad_accum > 1 the accumulator and, while a gradient is added into it, fp32 temporaries of the
    # largest tensor: its fp32 cast (compute dtype not fp32), and with DP and compiled layers the sum the overlap's
    # hooks make out of place before they drop the old one (parallel/overlap.py GradReduction._add, ._arrive:
    # MindSpore refuses a hook's in-place write into the adopted gradients there). One DP rank adds after each
    # backward, its logits freed: there the cast counts only where it is larger than they are (measured on CPU:
    # make bench-memory's h256-fp16-ga4, docs/memory.md)
    accumulator = trained * 4 if grad_accum > 1 or (precision != "fp32" and dp > 1) else 0
    if grad_accum > 1 and lora is None:
        largest = max(sizes) * 4
        cast = largest * (precision != "fp32")
        accumulator += (cast if dp > 1 else max(0, cast - logits)) + largest * (dp > 1 and compile_layers)
    # on the host an untied fp32/fp16 embedding's gradient is summed as its rows until the step's last micro-batch
    # returns it whole, in numpy (parallel/vocab.py RowGradient): the step's rows and, while a micro-batch's are
    # merged, their union and the micro-batch's, in place of its [vocab, hidden] accumulator
    in_place = host and not (vocab_parallel and tp > 1)  # TiedGradient, RowGradient: the whole vocabulary
    tied = bool(model_config.get("tie_word_embeddings"))
    plain = lora is None and not (sharded and zero >= 2)  # ZeRO-2/3 reduce each micro-batch's dense gradients
    by_rows = vocab * h * 4 if in_place and not tied and precision != "bf16" and plain else 0
    if by_rows and grad_accum > 1:
        accumulator += 2 * min(vocab, grad_accum * tokens) * h * 4 - by_rows
    elif by_rows and accumulator:  # one micro-batch cast in DP's hooks: the lookup's fp32 gradient is its own total
        accumulator -= by_rows
    # the micro-batch's gradients in the compute dtype; the embedding's, from its rows, in fp32 (RowLookup)
    grad_nbytes = (adapters * 4 + saved * nbytes) if lora else trained * nbytes + (by_rows // 4) * (4 - nbytes)
    # the accumulator is dropped bucket by bucket as the reduction launches (GradReduction._arrive)
    totals = state * 4
    # over the largest operand (a tensor, or a bucket's chunk), on the NPU: the gradient times the clip factor and
    # its zeroed-when-skipped copy (optim/update.py StepGate.update: one gradient at a time, never all), the
    # kernel's new w, m, v and two temporaries; on CPU the kernel writes in place, the factor applied chunk by
    # chunk (optim/host.py)
    kernel = min(state, math.ceil(BUCKET_BYTES // 4 / dp) if sharded else max(sizes)) if not host else 0
    update = 7 * kernel * 4
    collectives = 0
    if dp > 1 and not PLATFORMS[device].native_collectives:  # the shared-memory regions
        # the largest bucket: ShardLayout's (sharded), else buckets_by_bytes' (a larger tensor alone)
        largest = BUCKET_BYTES // 4 if sharded or lora else max(BUCKET_BYTES // 4, max(sizes))
        collectives = host_slot_bytes(min(trained, largest), dp, sharded, nbytes)
    elif dp > 1:
        collectives = min(trained * 4, BUCKET_BYTES)
    staging = 0
    if host:  # numpy copies of the trained weights in fp32 and of the optimizer state (io/checkpoint.py
        # save_checkpoint: astype's and the optimizer's snapshot copies; safetensors writes from their memory)
        staging = trained * 4 + 2 * state * 4 + master
    tied_host = head_rows * h * 4 if in_place and tied and lora is None else 0  # TiedGradient's one buffer
    # (in the micro-batch's grads and, with one, the accumulator's)
    host_logits = logits if host and precision == "fp32" else 0  # LMHeadCrossEntropy.host_gemm: numpy's
    z = zero_terms(zero if sharded else 0, n=n, adapters=adapters, grads=grad_nbytes, accumulator=accumulator,
                   trained=trained, state=state, layers=layer_elements(local), nbytes=nbytes, dp=dp,
                   grad_accum=grad_accum, device=device, lora=lora is not None)
    return MemoryEstimate(weights=z.weights, grads=z.grads, master=master, optimizer=2 * state * 4,
                          activations=acts, workspace=CPU_WORKSPACE_BYTES if host else WORKSPACE_BYTES,
                          accumulator=z.accumulator, logits=logits, totals=totals, update=update,
                          collectives=collectives, staging=staging, grad_shards=z.grad_shards,
                          rs_buckets=z.rs_buckets, gathered=z.gathered, gather_buffer=z.gather_buffer,
                          host_layers=z.host_layers,
                          tied=0 if lora else tied_bytes(model_config, head_rows, precision, in_place=in_place),
                          host_backward=host_logits + tied_host * (2 if z.accumulator else 1) + by_rows,
                          host_step=tied_host + by_rows, host_apart=min(host_logits, by_rows),
                          graphs=graph_bytes(model_config, tokens, seq_len, lora is not None)
                          if compile_layers and not PLATFORMS[device].fused_kernels else 0)


def memory_estimate(recipe: Recipe, cfg: dict[str, Any],
                    estimator: Callable[..., MemoryEstimate] = estimate_memory) -> MemoryEstimate:
    """The per-device estimate of a resolved recipe's layout on the model of ``cfg`` (config.json): its
    :class:`TrainShape` (as ``parallel.tp: auto`` estimates it) at the layout's TP, DP and sequence; preflight
    prints it, the trainer compares it with the measured peak at step 1."""
    layout = recipe.decided_layout
    shape = dataclasses.replace(TrainShape.of(recipe, layout.device), zero=layout.zero or 1)
    return shape.estimate(cfg, layout.tp, layout.dp, layout.seq_len, estimator)


# ---------------------------------------------------------------------------- what the estimate takes of a recipe

@dataclass(frozen=True)
class TrainShape:
    """What the estimate takes of a recipe besides the layout and the sequence; the defaults are how the NPU
    recipes fully fine-tune (micro batch 1, recompute, the optimizer sharded over DP, vocab-parallel with
    TP > 1, the loss over chunks of ``train.loss_chunk_tokens``' default)."""

    precision: str = "bf16"
    micro_batch_size: int = 1
    recompute: bool = True
    shard_optimizer: bool = True  # over DP when DP > 1
    vocab_parallel: bool = True  # when TP > 1
    loss_chunk_tokens: int = TrainConfig.loss_chunk_tokens
    lora: LoraConfig | None = None  # train.method=lora
    grad_accum: int = 8  # the NPU recipes'
    device: str = "npu"
    compile_layers: bool = False  # train.compile_layers (CPU only)
    zero: int = 1  # the ZeRO stage over DP when the optimizer is sharded (parallel.zero; auto: the plan's choice)

    @classmethod
    def of(cls, recipe: Recipe, device: str) -> TrainShape:
        """The shape of ``recipe`` trained on ``device`` ('npu' | 'cpu')."""
        t, p = recipe.train, recipe.parallel
        return cls(t.precision_on(device), t.micro_batch_size, t.recompute, p.shard_optimizer is not False,
                   p.vocab_parallel, t.loss_chunk_tokens, recipe.lora if t.method == "lora" else None,
                   t.grad_accum, device, bool(t.compile_layers), p.zero if isinstance(p.zero, int) else 1)

    def estimate(self, cfg: dict[str, Any], tp: int, dp: int, seq_len: int,
                 estimator: Callable[..., MemoryEstimate] = estimate_memory) -> MemoryEstimate:
        return estimator(cfg, seq_len=seq_len, micro_batch_size=self.micro_batch_size, tp=tp, dp=dp,
                               precision=self.precision, recompute=self.recompute,
                               shard_optimizer=self.shard_optimizer, vocab_parallel=self.vocab_parallel and tp > 1,
                               loss_chunk_tokens=self.loss_chunk_tokens, lora=self.lora,
                               grad_accum=self.grad_accum, device=self.device, zero=self.zero,
                               compile_layers=self.compile_layers)


FULL_FT = TrainShape()
