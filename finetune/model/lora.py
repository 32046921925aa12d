"""LoRA adapters on the frozen base model (``train.method: lora``), as peft computes them.

:func:`apply_lora` freezes every base weight (held in the compute dtype, no master, no optimizer state)
and attaches a :class:`LoraAdapter` to each targeted linear layer of a built model:
``y = base(x) + scale * B @ A @ dropout(x)``. The adapters stay fp32 (their own masters for AdamW).

Tensor parallelism follows the base layer's split in the layout table (jobspec/model_layout.py): a
column-parallel layer (split output rows) keeps A ``[r, in]`` whole on every rank and splits B
``[out, r]`` like its output; its gradient of ``A @ x`` is summed over the TP group (``CopyToTP``).
A row-parallel layer (split input columns) splits A like its input and keeps B whole; ``A @ x`` is
summed over the TP group forward (``ReduceFromTP``). Parameter names are the layer's plus
``.lora_A.weight`` / ``.lora_B.weight`` (peft's without ``base_model.model.`` and ``.default``).
"""
from __future__ import annotations

import math
import zlib

import mindspore as ms
import numpy as np
from mindspore import Parameter, nn, ops
from mindspore.ops.operations.math_ops import Bernoulli

from finetune.dist import RankInfo
from finetune.io.reshard import cut
from finetune.optim.update import write_param
from finetune.parallel.layers import ColumnParallelLinear, CopyToTP, ReduceFromTP, RowParallelLinear, linear
from jobspec.lora_config import TARGETS, LoraConfig, module_path
from jobspec.model_layout import TPSlice


class MaskKey:
    """Where the dropout masks are drawn: ``(train.seed, step, micro-batch)``, set before each micro-batch's
    forward (``advance``, called by Training.scaled_loss). Each adapter adds its module path and rank
    (:meth:`of`), so a mask is a function of (seed, step, micro-batch, layer, module, rank) alone: a resumed
    run draws the masks of the uninterrupted one, and a recomputed layer draws its forward's again."""

    def __init__(self, seed: int) -> None:
        self.seed, self.step, self.micro = seed, -1, 0
        self.drawn: list[LoraAdapter] = []  # adapters inside compiled layers: their masks drawn ahead

    def advance(self, step: int, rows: tuple[int, int]) -> None:
        """The next micro-batch's forward (``rows``: its [batch, sequence] shape): the first of ``step``,
        or the one after the last."""
        self.micro = self.micro + 1 if step == self.step else 0
        self.step = step
        for adapter in self.drawn:
            adapter.draw(rows)

    def of(self, module: str, rank: str) -> int:
        """The 31-bit seed of one adapter's mask now."""
        return zlib.crc32(f"{self.seed}/{self.step}/{self.micro}/{module}/{rank}".encode()) & 0x7FFFFFFF


def keyed_mask(x, keep: float, key: int, generator: ms.Generator | None):
    """A {0, 1} mask like ``x`` (1 with probability ``keep``) drawn from ``key`` alone: the Bernoulli
    primitive seeded with it (CPU, GPU), or on Ascend (``generator``: the adapter's own, made once) BernoulliExt
    with that generator seeded again with it (not run on this project's CPU tests)."""
    if generator is not None:
        from mindspore import mint

        generator.manual_seed(key)
        return mint.bernoulli(ops.full_like(x, keep), generator=generator)
    return Bernoulli(key)(x, ms.Tensor([keep], ms.float32))  # a new primitive: its cache would keep every seed


class LoraAdapter(nn.Cell):
    """``scale * B @ A @ dropout(x)`` for one linear layer (``column``: the layer splits its output).

    Op by op the dropout mask is drawn in the forward. Inside a compiled layer (``pre_draw``) the key of a
    mask is host state a graph would freeze at its first call, so :meth:`draw` puts each micro-batch's mask
    into a Parameter the graph reads (``MaskKey.advance``, before the forward): the same mask, the same bits.
    """

    def __init__(self, a: Parameter, b: Parameter, scale: float, dropout: float, column: bool, base, rank: RankInfo,
                 masks: MaskKey, module: str):
        super().__init__()
        self.lora_A, self.lora_B, self.scale, self.dtype = a, b, scale, base.dtype
        self.dropout, self.masks, self.module = dropout, masks, module
        # Ascend: one generator per adapter, seeded again for each mask (not a new one per forward)
        self.generator = ms.Generator() if rank.platform.fused_kernels and dropout > 0 else None
        # x is whole and the same on every TP rank of a column-parallel layer: the same mask there
        self.rank_key = f"dp{rank.dp_rank}" + ("" if column or rank.tp == 1 else f"tp{rank.tp_rank}")
        self.comm = (CopyToTP if column else ReduceFromTP)(rank) if rank.tp > 1 else None
        self.share = getattr(base, "share", None)  # KV heads copied on several TP ranks: B summed like W
        self.pre_draw, self.drop = False, None
        self.by_shape: dict[tuple[int, ...], Parameter] = {}  # one mask Parameter per input shape

    def draw(self, rows: tuple[int, int]) -> None:
        """This micro-batch's mask for an input of ``rows`` x A's input width, into the Parameter of that
        shape (a graph compiled for a shape reads that shape's Parameter)."""
        shape = (*rows, self.lora_A.shape[1])
        key = self.masks.of(self.module, self.rank_key)
        mask = keyed_mask(ops.zeros(shape, dtype=self.dtype), 1.0 - self.dropout, key, self.generator)
        if shape in self.by_shape:
            write_param(self.by_shape[shape], mask)
        else:
            self.by_shape[shape] = Parameter(mask, name=f"{self.module}.lora_dropout_mask", requires_grad=False)
        self.drop = self.by_shape[shape]

    def construct(self, x):
        if self.dropout > 0 and self.training:
            keep = 1.0 - self.dropout
            mask = self.drop if self.pre_draw else keyed_mask(x, keep, self.masks.of(self.module, self.rank_key),
                                                              self.generator)
            x = x * mask * (1.0 / keep)
        h = linear(x, self.lora_A, None, self.dtype)
        if self.comm is not None:
            h = self.comm(h)
        b = self.share(self.lora_B) if self.share is not None else self.lora_B
        return linear(h, b, None, self.dtype) * self.scale


def init_weights(cfg: LoraConfig, module: str, r: int, fan_in: int, out: int, seed: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Full A ``[r, in]`` and B ``[out, r]`` (fp32), the same for every layout: peft's default is A
    Kaiming-uniform (a=sqrt(5): U(+-1/sqrt(in))) and B zero; gaussian: A ~ N(0, 1/r)."""
    rng = np.random.default_rng([seed, zlib.crc32(module.encode())])
    if cfg.init == "gaussian":
        a = rng.normal(0.0, 1.0 / r, (r, fan_in))
    else:
        bound = 1.0 / math.sqrt(fan_in)
        a = rng.uniform(-bound, bound, (r, fan_in))
    return a.astype(np.float32), np.zeros((out, r), np.float32)


def _param(full: np.ndarray, part: TPSlice | None) -> Parameter:
    p = Parameter(ms.Tensor(cut(full, part), ms.float32))
    p.hf_shape, p.tp_slice = full.shape, part  # as the model marks its weights (reshard, grad norm, export)
    if part is not None:
        p.tp_axis, p.tp_owner = part.axis, part.owner
    return p


def targeted(model, cfg: LoraConfig) -> list[tuple[str, ColumnParallelLinear | RowParallelLinear]]:
    """(module path, linear layer) of every layer the config targets, in model order."""
    out: list[tuple[str, ColumnParallelLinear | RowParallelLinear]] = []
    for n, layer in enumerate(model.model.layers):
        for name in TARGETS:
            path = module_path(n, name)
            if cfg.targets(path):
                out.append((path, getattr(layer.self_attn if name in TARGETS[:4] else layer.mlp, name)))
    return out


def apply_lora(model, cfg: LoraConfig, seed: int) -> list[Parameter]:
    """Freeze ``model`` and attach adapters; returns the trainable parameters (adapters, then the
    ``modules_to_save`` weights) for the optimizer."""
    if any(getattr(layer, "_recompute_cell", None) is not None for layer in model.model.layers):
        raise ValueError("apply_lora on recomputed layers: their recompute cells differentiate the parameters "
                         "trainable when recompute() was called; attach the adapters first, then "
                         "model.model.recompute_layers()")
    for p in model.get_parameters():
        p.requires_grad = False
    model.lora_masks = MaskKey(seed)
    for path, lin in targeted(model, cfg):
        column = isinstance(lin, ColumnParallelLinear)
        out, fan_in = lin.weight.hf_shape
        a, b = init_weights(cfg, path, cfg.r, fan_in, out, seed)
        part = lin.weight.tp_slice
        pa = _param(a, None if column else part)
        pb = _param(b, part if column else None)
        lin.adapter = LoraAdapter(pa, pb, cfg.scale, cfg.dropout, column, lin, model.rank, model.lora_masks, path)
        if model.model.graphs and cfg.dropout > 0:  # compiled layers: masks drawn ahead (LoraAdapter.draw)
            lin.adapter.pre_draw = True
            model.lora_masks.drawn.append(lin.adapter)
        pa.name, pb.name = f"{path}.lora_A.weight", f"{path}.lora_B.weight"  # attaching renamed them
    saved = {"embed_tokens": "model.embed_tokens.weight",
             "lm_head": "lm_head.weight" if model.lm_head is not None else "model.embed_tokens.weight"}
    state, full = model.hf_state(), [saved[m] for m in dict.fromkeys(cfg.modules_to_save)]
    for name in full:
        state[name].requires_grad = True
    model.loss_fn.weight_grad = state[saved["lm_head"]].requires_grad  # a frozen head: no weight gradient matmul
    return adapters(model) + [state[name] for name in dict.fromkeys(full)]


def adapters(model) -> list[Parameter]:
    """Every adapter parameter (A, B per layer), in model order."""
    return [p for p in model.get_parameters() if p.name.endswith((".lora_A.weight", ".lora_B.weight"))]


def merged_delta(a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """What the adapter adds to the layer's full weight: ``scale * B @ A`` (fp32)."""
    return (scale * (b.astype(np.float64) @ a.astype(np.float64))).astype(np.float32)
