"""Training setup: the model, optimizer, data and resume, gathered into one :class:`Training`.

``setup`` builds everything the loop in ``finetune/run/loop.py`` reads and changes; ``Training.save``
and ``Training.restore`` write and read all of it as one object (weights, optimizer, data position,
loss scale and counters together).
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import ops

from finetune.dist import RankInfo
from finetune.io.checkpoint import CheckpointMismatch, TrainerState, load_checkpoint, load_latest, save_checkpoint
from finetune.optim import AdamW, LossScaler, Optimizer, ShardedAdamW
from finetune.parallel.overlap import GradReduction, reduction_for
from jobspec.checkpoint_index import condemn, run_identity, usable, ways_out
from jobspec.config import Recipe, TrainConfig
from jobspec.data.batching import BatchLoader
from jobspec.rerun import changed_settings, run_settings
from jobspec.rundir import RunDir

BATCH_KEYS = ("input_ids", "labels", "position_ids", "segment_ids")


def batch_tensors(mb: dict[str, np.ndarray]) -> list[ms.Tensor]:
    """A micro-batch as the model's int32 arguments (``BATCH_KEYS`` order). The labels and segment ids keep
    their host arrays as ``.host``: the loss picks its labelled rows and the fused attention builds its spec
    from them without reading the device (model.labelled_rows, DecoderModel._mask)."""
    tensors = [ms.Tensor(mb[k], ms.int32) for k in BATCH_KEYS]
    tensors[1].host, tensors[-1].host = mb["labels"], mb["segment_ids"]
    return tensors


@dataclass
class Training:
    """Everything the loop reads and changes; saved and resumed as one object."""

    recipe: Recipe
    run: RunDir  # every path of the run (plan.json's run_dir)
    rank: RankInfo
    model: Any  # DecoderLM
    model_dir: Path
    params: list
    opt: Optimizer  # AdamW or ShardedAdamW
    reduction: GradReduction  # the DP gradient reduction by the optimizer's buckets
    scaler: LossScaler
    loader: BatchLoader
    val_loader: BatchLoader | None  # the validation set (data.val_size / data.val_paths), if any
    total_steps: int
    step: int = 0
    tokens_seen: int = 0
    elapsed_before_s: float = 0.0  # training time of earlier runs this one resumed
    started: float = field(default_factory=time.time)
    identity: dict = field(default_factory=dict)  # the base model and token cache (checkpoint.run_identity)
    best_eval: float = math.inf  # train.early_stop_patience: the best eval loss so far
    evals_without_gain: int = 0  # and the evaluations since it
    skipped_steps: int = 0  # steps skipped for non-finite gradients, over this run and those it resumed
    bad_streak: int = 0  # consecutive non-finite steps up to the last sync point (no checkpoint while > 0)
    finished_at: Path | None = None  # the run's final checkpoint when it resumed one (its export is redone)
    zero3: Any = None  # ZeRO-3's sharded layer weights (finetune/parallel/zero3.py), or None

    @property
    def owns_model(self) -> bool:
        """Whether this rank writes the model's weights (checkpoint, export): DP rank 0 of each TP rank."""
        return self.rank.dp_rank == 0

    def host_weights(self) -> contextlib.AbstractContextManager:
        """Every weight whole inside on the rank that writes the model (ZeRO-3 streams the layers to its host,
        layer by layer: collective; the other ranks keep their shards); nothing to do otherwise."""
        return self.zero3.on_host(self.owns_model) if self.zero3 is not None else contextlib.nullcontext()

    def nonfinite_weights(self) -> list[str]:
        """The names of this rank's weights holding a non-finite value (ZeRO-3: its chunks of the decoder layers
        and the whole others, no gather)."""
        sharded = self.zero3.sharded if self.zero3 is not None else set()
        bad = [p.name for i, p in enumerate(self.params) if i not in sharded and not bool(ops.isfinite(p).all())]
        return bad + (self.zero3.nonfinite() if self.zero3 is not None else [])

    def elapsed_s(self) -> float:
        """Training wall time over this run and the runs it resumed."""
        return self.elapsed_before_s + time.time() - self.started

    def scaled_loss(self, input_ids, labels, position_ids, segment_ids, scale):
        """The summed token loss times ``scale`` (loss scale / label tokens of the global batch)."""
        masks = getattr(self.model, "lora_masks", None)  # LoRA dropout: masks keyed by step and micro-batch
        if masks is not None:
            masks.advance(self.step, input_ids.shape)
        return self.model(input_ids, labels, position_ids, segment_ids) * scale

    def save(self, finished: bool = False) -> Path:
        """Checkpoint every part at the current step (collective: every rank calls it); ``finished``: the
        run's final one."""
        state = TrainerState(step=self.step, loader=self.loader.state_dict(), scaler=self.scaler.state_dict(),
                             seed=self.recipe.train.seed, tokens_seen=self.tokens_seen,
                             elapsed_s=self.elapsed_s(), identity=self.identity,
                             best_eval=None if math.isinf(self.best_eval) else self.best_eval,  # JSON has no inf
                             evals_without_gain=self.evals_without_gain, skipped_steps=self.skipped_steps,
                             bad_streak=self.bad_streak, settings=run_settings(self.recipe), finished=finished)
        sharded = self.opt.sharded
        with self.host_weights():
            path = save_checkpoint(self.run.checkpoints, state, self.params, self.opt.state_dict(), self.rank,
                                   self.recipe.train.keep_checkpoints, owns_model=self.owns_model,
                                   owns_optim=sharded or self.rank.dp_rank == 0)
        self.rank.log(f"[train] checkpoint {path}")
        return path

    def restore(self, path: Path | None) -> None:
        """Continue from the checkpoint at ``path`` (None: the newest one that verifies, if any): weights,
        optimizer, data position, loss scale, counters."""
        shard = self.opt.sharded
        if path is None:
            found = load_latest(self.run.checkpoints, self.params, self.rank, shard, self.identity, print)
            if found is None:
                return
            path, state, optim_state = found
        else:
            state, optim_state = load_checkpoint(path, self.params, self.rank, shard, self.identity)
        changes = changed_settings(state.settings, self.recipe)
        if changes:  # the launcher refuses this before any work; a worker started by hand meets it here
            raise CheckpointMismatch(f"{path} was trained with other settings: {'; '.join(changes)}. "
                                     f"{ways_out(self.run.root)}")
        self.opt.load_state_dict(optim_state)
        self.loader.load_state_dict(state.loader)
        self.scaler.load_state_dict(state.scaler)
        self.step, self.tokens_seen, self.elapsed_before_s = state.step, state.tokens_seen, state.elapsed_s
        self.best_eval = math.inf if state.best_eval is None else state.best_eval
        self.evals_without_gain = state.evals_without_gain
        self.skipped_steps = state.skipped_steps
        self.finished_at = path if state.finished else None
        self.started = time.time()
        self.rank.log(f"[train] resumed from {path} at step {self.step}" + (
            f" ({self.skipped_steps} non-finite steps skipped so far)" if self.skipped_steps else ""))

    def condemn_start_of_streak(self) -> None:
        """The run stops in a bad streak: the checkpoint of the weights it started from, if any, is marked
        unhealthy (their update made every later loss non-finite); one rank per node marks its copy."""
        if self.bad_streak and self.rank.local_rank == 0:
            condemn(self.run.checkpoint(self.step - self.bad_streak), f"every one of the {self.bad_streak} steps after "
                    "it had non-finite gradients until the run stopped (its weights are finite but blown up)")

    def newest_healthy(self) -> Path | None:
        """The checkpoint a rerun would resume (the newest complete and healthy one), if any."""
        found = usable(self.run.checkpoints, log=lambda _: None)
        return found[0] if found else None


def setup(recipe: Recipe, rank: RankInfo, dtype, run: RunDir, model_hash: str = "") -> Training:
    """Model, optimizer, loss scaler and data for this rank of the finished ``recipe`` (jobspec/finish.py) in
    ``run``, resumed when a checkpoint says so; ``model_hash``: the base model's identity from the plan
    (jobspec.checkpoint_index.model_hash)."""
    tc = recipe.train
    model_dir = Path(recipe.model.dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json; set MODEL_DIR (model.dir) to a Hugging Face Qwen2 "
                                "model directory, or start through the launcher, which creates the tiny default "
                                "model (model.init)")
    loader, val_loader = build_loaders(recipe, rank, run)
    total_steps = min(tc.max_steps, loader.total_steps) if tc.max_steps else loader.total_steps
    if total_steps == 0:
        what = "token-budget batches" if loader.dynamic else "packed sequences" if recipe.data.packing else "sequences"
        raise ValueError(
            f"the data gives no full global batch: {len(loader.index)} samples make {len(loader.units)} {what}, a "
            f"global batch takes {loader.per_step} ("
            + ("" if loader.dynamic else f"train.micro_batch_size {tc.micro_batch_size} x ")
            + f"train.grad_accum {tc.grad_accum} x dp {rank.dp}); lower train.micro_batch_size or train.grad_accum, "
            "use fewer workers, or add data")
    rank.log(f"[train] building the model and loading the weights of {model_dir}")
    model, params = build_model(recipe, rank, model_dir, dtype)
    layout = recipe.decided_layout
    opt = build_optimizer(params, tc, rank, layout.shard_optimizer)
    overlap = layout.overlap_grad_reduce
    zero3, reduction = None, None
    if layout.shard_weights:
        from finetune.parallel.zero3 import Zero3Reduction, shard_layers

        zero3 = shard_layers(model, opt, rank)
        if tc.method == "lora":  # the adapters are the sharded weights above; the frozen base is sharded beside them
            from finetune.parallel.zero3_lora import shard_frozen_base

            shard_frozen_base(model, zero3, rank)
        reduction = Zero3Reduction(params, opt, zero3)
    trainer = Training(recipe, run, rank, model, model_dir, params, opt,
                      reduction or reduction_for(params, opt, layout, rank, bool(tc.compile_layers)),
                      LossScaler(tc.loss_scale, enabled=dtype == ms.float16), loader, val_loader, total_steps,
                      zero3=zero3)
    if rank.dp > 1:
        rank.log(f"[train] DP gradient reduction in {len(opt.bucket_params)} bucket(s), "
                 + ("each started by the backward as soon as its gradients exist" if overlap else
                    "after the backward (parallel.overlap_grad_reduce: false)"))
    n_params = sum(int(np.prod(p.shape)) for p in params)
    rank.log(f"[train] {n_params / 1e6:.2f} M parameters on this rank, {total_steps} steps "
             f"({loader.steps_per_epoch} per epoch), global batch "
             f"{layout.global_batch} x {layout.seq_len} tokens")
    # the launcher hashed the base model once per node (model_hash); a worker started without it hashes here
    trainer.identity = run_identity(model_dir, run.data, model_hash or None, run.hashes)
    if tc.method == "lora":  # resuming adapters of another shape or a full run's checkpoint is refused
        from finetune.io.lora_io import lora_identity

        trainer.identity.update(lora_identity(recipe.lora))
    if tc.resume != "never":  # auto: the newest checkpoint that verifies; else the path it names
        trainer.restore(None if tc.resume == "auto" else Path(tc.resume))
    if zero3 is not None:  # restored whole; from now on each rank keeps its shard
        zero3.release()
    return trainer


def build_loaders(recipe: Recipe, rank: RankInfo, run: RunDir) -> tuple[BatchLoader, BatchLoader | None]:
    """This DP rank's deterministic training batches from the token cache in ``run.data`` (prepared once per
    node or job), and its share of the validation set when the cache holds one."""
    from jobspec.data.cache import INDEX, VAL_INDEX
    from jobspec.data.prepare import ensure_cache
    from jobspec.data.runcheck import Resumed

    tc, d = recipe.train, recipe.data
    cache = ensure_cache(d, run.data, recipe.model.tokenizer, rank, progress=rank.is_main,
                         resumed=Resumed.of(run, tc.resume))

    def loader(index_name: str) -> BatchLoader:
        return BatchLoader(cache.dir, d.seq_len, tc.micro_batch_size, tc.grad_accum, rank.dp, rank.dp_rank, tc.seed,
                           packing=d.packing, max_tokens_per_batch=d.max_tokens_per_batch, epochs=tc.epochs,
                           index_name=index_name)

    return loader(INDEX), loader(VAL_INDEX) if cache.num_val else None


def build_model(recipe: Recipe, rank: RankInfo, model_dir: Path, dtype) -> tuple[Any, list]:
    """This rank's slice of the model with the Hugging Face weights loaded; (model, trainable params)."""
    from finetune.io.hf_io import load_hf_config, load_weights
    from finetune.model.decoder import DecoderLM, ModelConfig

    tc = recipe.train
    ms.set_seed(tc.seed)
    cfg, layout = ModelConfig.from_dict(load_hf_config(model_dir)), recipe.decided_layout
    model = DecoderLM(cfg, rank, compute_dtype=dtype,
                             vocab_parallel=layout.vocab_parallel, loss_chunk_tokens=tc.loss_chunk_tokens)
    load_weights(model, model_dir, rank)
    if tc.compile_layers:  # decided by Recipe.resolved (config.compile_layers_refusals)
        model.model.compile_layers()
        rank.log(f"[train] each of the {len(model.model.graphs)} decoder layers runs as one graph "
                 "(train.compile_layers; the first step compiles them, train.compile_layers=false: op by op)")
    params = model.trainable_params()
    model.cast_params(dtype)  # low-precision weights; the optimizer keeps fp32 masters
    if tc.method == "lora":  # the base frozen in the compute dtype; the optimizer gets the fp32 adapters
        from finetune.model.lora import apply_lora

        params = apply_lora(model, recipe.lora, tc.seed)
    # last: the recomputed layers differentiate the parameters trainable now (ZeRO-3 recomputes each layer itself)
    if tc.recompute and not layout.shard_weights:
        model.model.recompute_layers()
    model.set_train(True)  # training mode: the LM head keeps its logits for the backward (evaluate() leaves it)
    return model, params


def build_optimizer(params: list, cfg: TrainConfig, rank: RankInfo, shard: bool) -> Optimizer:
    """AdamW, or its data-parallel sharded version when ``shard`` (the layout's: only with dp > 1)."""
    if shard:
        return ShardedAdamW(params, cfg, rank)
    return AdamW(params, cfg, rank)
