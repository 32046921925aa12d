"""The training loop: one function, top to bottom, run by every rank.

Configured only by the resolved recipe and the rank environment msrun gives the process.
"""
from __future__ import annotations

import glob
import signal
import time
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import ops

from finetune.checkpoint import (TrainerState, checkpoint_root, find_latest, load_checkpoint,
                                 save_checkpoint)
from finetune.config import Recipe, creates_tiny_model, resolved_model_dir
from finetune.dist import RankInfo, barrier, init_distributed, launched_world
from finetune.metrics import MetricsWriter, log, progress_line, summarize
from finetune.optim import LossScaler, build_optimizer, lr_at


def device_target(recipe: Recipe) -> str:
    """'Ascend' or 'CPU' from launch.device (auto: Ascend when /dev/davinciN exists)."""
    if recipe.launch.device == "npu":
        return "Ascend"
    if recipe.launch.device == "cpu":
        return "CPU"
    return "Ascend" if glob.glob("/dev/davinci[0-9]*") else "CPU"


def compute_dtype(recipe: Recipe):
    """The dtype of weights and matmuls of a resolved recipe (fp32 master weights live in the optimizer)."""
    return {"fp32": ms.float32, "bf16": ms.bfloat16, "fp16": ms.float16}[recipe.train.precision]


class _StopFlag:
    """Set by SIGTERM/SIGINT; the loop checkpoints and exits at the next step boundary."""

    def __init__(self):
        self.set = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        self.set = True


def _dp_sum(values: list[float], rank: RankInfo) -> list[float]:
    """Sum scalars over the data-parallel group (identity when dp == 1)."""
    if rank.dp == 1:
        return values
    t = ops.AllReduce(group=rank.dp_group)(ms.Tensor(np.array(values, np.float32)))
    return t.asnumpy().tolist()


def _world_any(flag: bool, rank: RankInfo) -> bool:
    """True on every rank if it is True on any rank (keeps ranks in step when stopping)."""
    if rank.world_size == 1:
        return flag
    t = ops.AllReduce()(ms.Tensor(np.array([1.0 if flag else 0.0], np.float32)))
    return bool(t.asnumpy()[0] > 0)


def run(recipe: Recipe) -> int:
    """Fine-tune as the recipe says; returns the process exit code."""
    from finetune.data.prepare import ensure_cache
    from finetune.data.batching import BatchLoader
    from finetune.hf_io import export_hf, load_hf_config, load_weights
    from finetune.model import Qwen2Config, Qwen2ForCausalLM

    t_start = time.time()
    device = device_target(recipe)
    # the plan's recipe is resolved already: this only checks it against the world msrun started
    recipe = recipe.resolved(launched_world(), "npu" if device == "Ascend" else "cpu")
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target=device)
    rank = init_distributed(recipe.parallel.tp, recipe.parallel.dp, device)
    say = log if rank.is_main else (lambda msg: None)
    out = Path(recipe.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tc = recipe.train
    dtype = compute_dtype(recipe)
    head = ("vocab-parallel" if recipe.parallel.vocab_parallel else "replicated") if rank.tp > 1 else "whole"
    say(f"[train] device {device}, world {rank.world_size} (tp {rank.tp} x dp {rank.dp}, embedding/LM head "
        f"{head}), compute dtype {dtype}, output {out}")

    # --- model directory (created once for the embedded default) and data cache
    model_dir = Path(resolved_model_dir(recipe))
    if creates_tiny_model(recipe) and rank.local_rank == 0:
        from finetune.tiny import ensure_tiny_model

        if ensure_tiny_model(model_dir, recipe.model.init, recipe.model.init_seed):
            say(f"[train] created the tiny random-init model in {model_dir} (seed {recipe.model.init_seed})")
    barrier(rank)
    cache_dir = ensure_cache(recipe, model_dir / "tokenizer.json", rank, progress=rank.is_main).dir
    loader = BatchLoader(cache_dir, recipe.data.seq_len, tc.micro_batch_size, tc.grad_accum, rank.dp,
                         rank.dp_rank, tc.seed, packing=recipe.data.packing,
                         max_tokens_per_batch=recipe.data.max_tokens_per_batch, epochs=tc.epochs)
    total_steps = min(tc.max_steps, loader.total_steps) if tc.max_steps else loader.total_steps
    if total_steps == 0:
        raise ValueError(f"the data gives no full global batch of {tc.micro_batch_size * tc.grad_accum * rank.dp} "
                         "sequences: lower train.micro_batch_size / train.grad_accum or add data")

    # --- model, optimizer, loss scale
    ms.set_seed(tc.seed)
    cfg = Qwen2Config.from_dict(load_hf_config(model_dir))
    model = Qwen2ForCausalLM(cfg, rank, recompute=tc.recompute, compute_dtype=dtype,
                             vocab_parallel=recipe.parallel.vocab_parallel, loss_chunk_tokens=tc.loss_chunk_tokens)
    load_weights(model, model_dir, rank)
    params = model.trainable_params()
    model.cast_params(dtype)  # low-precision weights; the optimizer keeps fp32 masters
    shard = recipe.parallel.shard_optimizer
    opt = build_optimizer(params, tc, rank, shard=shard)
    scaler = LossScaler(tc.loss_scale, enabled=dtype == ms.float16)
    n_params = sum(int(np.prod(p.shape)) for p in params)
    say(f"[train] {n_params / 1e6:.2f} M parameters on this rank, {total_steps} steps "
        f"({loader.steps_per_epoch} per epoch), global batch "
        f"{tc.micro_batch_size * tc.grad_accum * rank.dp} x {recipe.data.seq_len} tokens")

    # --- resume
    root = checkpoint_root(out)
    step, tokens_seen, elapsed_before = 0, 0, 0.0
    latest = None if tc.resume == "never" else (Path(tc.resume) if tc.resume != "auto" else find_latest(root))
    if latest is not None:
        state, optim_state = load_checkpoint(latest, params, rank)
        opt.load_state_dict(optim_state)
        loader.load_state_dict(state.loader)
        scaler.load_state_dict(state.scaler)
        step, tokens_seen, elapsed_before = state.step, state.tokens_seen, state.elapsed_s
        say(f"[train] resumed from {latest} at step {step}")
    metrics = MetricsWriter(out / "metrics.jsonl", step) if rank.is_main else None

    def save() -> None:
        state = TrainerState(step=step, loader=loader.state_dict(), scaler=scaler.state_dict(), seed=tc.seed,
                             tokens_seen=tokens_seen, elapsed_s=elapsed_before + time.time() - t_loop)
        path = save_checkpoint(root, state, params, opt.state_dict(), rank, tc.keep_checkpoints,
                               owns_model=rank.dp_rank == 0, owns_optim=shard or rank.dp_rank == 0)
        say(f"[train] checkpoint {path}")

    def loss_fn(input_ids, labels, position_ids, segment_ids, scale):
        return model(input_ids, labels, position_ids, segment_ids) * scale

    grad_fn = ms.value_and_grad(loss_fn, None, params)
    stop = _StopFlag()

    # --- the loop
    t_loop, t_last, tokens_last = time.time(), time.time(), tokens_seen
    for batch in loader:
        if step >= total_steps:
            break
        lr = lr_at(step, tc, total_steps)
        scale = ms.Tensor(scaler.scale / batch.global_label_tokens, ms.float32)
        grads, loss_local, tokens_local = None, 0.0, 0
        for mb in batch.micro_batches:
            tensors = [ms.Tensor(mb[k], ms.int32) for k in ("input_ids", "labels", "position_ids", "segment_ids")]
            loss, g = grad_fn(*tensors, scale)
            grads = g if grads is None else tuple(a + b for a, b in zip(grads, g))
            loss_local += float(loss.asnumpy())
            tokens_local += int((mb["segment_ids"] > 0).sum())
        used_scale = scaler.scale
        grad_norm, applied = opt.step(grads, lr, grad_scale=used_scale)
        scaler.update(applied)
        loss_sum, tokens = _dp_sum([loss_local, float(tokens_local)], rank)
        step += 1
        tokens_seen += int(tokens)
        if not applied:
            say(f"[train] step {step}: non-finite gradients (loss scale {scaler.scale:g} after backoff), step skipped")
        if step % tc.log_every == 0 or step == total_steps:
            now = time.time()
            record = {"step": step, "loss": loss_sum / used_scale,
                      "lr": lr, "grad_norm": grad_norm, "tokens_per_s": (tokens_seen - tokens_last) / max(now - t_last, 1e-9),
                      "elapsed_s": round(elapsed_before + now - t_loop, 3), "loss_scale": used_scale}
            t_last, tokens_last = now, tokens_seen
            if metrics is not None:
                metrics.write(record)
                say(progress_line(record, total_steps))
        if tc.save_every and step % tc.save_every == 0 and step < total_steps:
            save()
        if _world_any(stop.set, rank):
            say(f"[train] stop requested: saving a checkpoint at step {step} and exiting")
            save()
            return 143

    # --- the end: checkpoint, Hugging Face export, summary
    save()
    if recipe.export.enabled:
        from finetune.config import parse_size

        hf_dir = out / "hf"
        export_hf(model, model_dir, hf_dir, recipe.export.dtype, parse_size(recipe.export.shard_size), rank)
        say(f"[train] Hugging Face model written to {hf_dir}")
    barrier(rank)
    if metrics is not None:
        summary = summarize(metrics.records, out, tokens_seen, elapsed_before + time.time() - t_loop)
        drop = (1 - summary["last_loss"] / summary["first_loss"]) * 100 if summary["first_loss"] else 0.0
        say(f"[train] done: {summary['steps']} steps, {summary['tokens']:,} tokens, loss "
            f"{summary['first_loss']:.4f} -> {summary['last_loss']:.4f} ({drop:.0f}% lower), "
            f"{summary['wall_time_s']:.0f}s; metrics in {out / 'metrics.jsonl'}, curve in {out / 'loss.png'}")
    return 0
