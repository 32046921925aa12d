"""The training loop: one function, top to bottom, run by every rank.

Configured only by the resolved recipe and the rank environment msrun gives the process. The
setup (model, optimizer, data, resume) is ``finetune/run/training.py``; this module runs the steps.

Host syncs: on Ascend a step copies nothing from the device. Clipping, skipping a non-finite step
and the fp16 loss scale happen on the device (finetune/optim/update.py ``StepGate``; on CPU, whose kernels
are synchronous, the norm is read once per step instead); the loss, grad norm, loss scale, skipped
steps, token counts and the stop request reach the host only at a *sync point*: a logged,
checkpoint, eval or last step, in one read. So a SIGTERM, and a run of train.max_bad_steps
non-finite steps, are acted on at the next sync point, at most train.log_every steps later.
"""
from __future__ import annotations

import signal
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import ops

from finetune.dist import all_reduce_sum, barrier, dp_totals, init_distributed, launched_world
from finetune.model.decoder import compute_dtype
from finetune.optim import SkippedSteps, UpdateCheck, lr_at
from finetune.parallel.overlap import GradReduction
from finetune.run.memcheck import naming_out_of_memory
from finetune.run.perf import StepProfiler
from finetune.run.progress import Reporter, evaluate
from finetune.run.training import Training, batch_tensors, setup
from jobspec.checkpoint_index import condemn
from jobspec.config import Recipe
from jobspec.plan_reader import unplanned
from jobspec.platform import platform_of
from jobspec.rundir import RunDir

EXIT_DIVERGED = 3  # train.max_bad_steps consecutive non-finite steps
EXIT_STOPPED = 143  # SIGTERM/SIGINT: checkpointed and stopped (128 + SIGTERM)
EVAL_MIN_GAIN = 1e-4  # an eval loss counts as better (train.early_stop_patience) when 0.01% lower


class StopFlag:
    """Set by SIGTERM/SIGINT; the loop checkpoints and exits at the next step boundary."""

    def __init__(self) -> None:
        self.set = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: object) -> None:
        self.set = True


def accumulate(grad_fn, micro_batches: list[dict[str, np.ndarray]], scale: ms.Tensor, reduction: GradReduction
               ) -> tuple[list, ms.Tensor]:
    """The gradients summed over the micro-batches in fp32 (whatever the compute dtype) and reduced
    over DP (the reduction's buckets, started by the last micro-batch's backward when it overlaps),
    and the summed scaled loss; both stay on the device.

    One fp32 accumulator per trained tensor (the first micro-batch's fp32 gradients, adopted): each later
    micro-batch's gradients are added into it in place (``GradReduction.add``) and dropped before the next forward,
    so at most the accumulator and one micro-batch's gradients are alive (jobspec/memory.py ``accumulator``).
    """
    acc: list | None = None
    loss_sum = None
    for n, mb in enumerate(micro_batches):
        last = n == len(micro_batches) - 1
        if last:
            reduction.arm(acc)
        loss, g = grad_fn(*batch_tensors(mb), scale)
        grads = list(g)
        del g  # the list alone holds them: the reduction drops each gradient once read
        loss_sum = loss if loss_sum is None else loss_sum + loss
        if last:
            return reduction.finish(grads), loss_sum
        acc = reduction.add(acc, grads)
    raise ValueError("a step needs at least one micro-batch")


def run(recipe: Recipe, run_dir: RunDir | None = None, model_hash: str = "") -> int:
    """Fine-tune as the finished recipe says into ``run_dir`` (plan.json's; None: a recipe without a plan, e.g. a
    test's, finished here as the launcher does, jobspec.plan_reader.unplanned; ``model_hash``: the plan's, see
    trainer.setup); returns the process exit code."""
    if run_dir is None:
        recipe, run_dir, _ = unplanned(recipe)
    # the plan's recipe comes resolved: this checks its layout against the world msrun started (a recipe
    # without a plan, e.g. a test's, is resolved here for that world on its launch.device)
    device = recipe.layout.device if recipe.layout else platform_of(recipe.launch.device).device
    recipe = recipe.resolved(launched_world(), device)
    layout = recipe.decided_layout
    ms.set_context(mode=ms.PYNATIVE_MODE)
    rank = init_distributed(layout)
    dtype = compute_dtype(recipe.train.precision)  # fp32 master weights live in the optimizer
    head = ("vocab-parallel" if layout.vocab_parallel else "replicated") if rank.tp > 1 else "whole"
    rank.log(f"[train] device {layout.device_target}, world {rank.world_size} (tp {rank.tp} x dp {rank.dp}, "
             f"embedding/LM head {head}), compute dtype {dtype}, output {recipe.output_dir}")
    with naming_out_of_memory(run_dir.plan, lambda: "while loading the model and the optimizer state"):
        trainer = setup(recipe, rank, dtype, run_dir, model_hash)
    reporter = Reporter(trainer)
    with naming_out_of_memory(run_dir.plan, lambda: f"after {trainer.step} of {trainer.total_steps} steps"):
        code = train_loop(trainer, reporter, StopFlag())
    if code:
        return code
    return finish(trainer, reporter)


def train_loop(t: Training, reporter: Reporter, stop: StopFlag) -> int:
    """Run the steps from ``t.step`` to ``t.total_steps`` (or an early stop); the exit code (0: finish)."""
    tc, rank = t.recipe.train, t.rank
    grad_fn = ms.value_and_grad(t.scaled_loss, None, t.reduction.taped(t.params))
    batches = iter(t.loader)  # positioned at step t.step; pulled only for a step that runs
    profiler = StepProfiler(tc.profile_steps, rank, t.run.profile)
    timer = reporter.timer
    pending_tokens, skipped = 0, SkippedSteps()
    update_check = UpdateCheck(t.opt, tc.lr)  # fails the run at the first sync point if no weight changed
    while t.step < t.total_steps:
        profiler.before(t.step + 1)
        timer.start()
        batch = next(batches)
        timer.mark("data")
        lr, loss_scale = lr_at(t.step, tc, t.total_steps), t.scaler.scale
        grads, loss = accumulate(grad_fn, batch.micro_batches, t.scaler.loss_factor(batch.global_label_tokens),
                                 t.reduction)
        timer.mark("fwd_bwd")
        grad_norm, applied = t.opt.apply(grads, lr, t.scaler.grad_scale)
        del grads  # the step's totals, not held through a checkpoint save or an eval (docs/memory.md)
        timer.mark("optimizer")
        t.scaler.update(applied)
        skipped.update(applied)
        t.step += 1
        profiler.after(t.step)
        pending_tokens += sum(int((mb["segment_ids"] > 0).sum()) for mb in batch.micro_batches)

        last = t.step == t.total_steps
        logged = t.step % tc.log_every == 0 or last
        saving = tc.save_every and t.step % tc.save_every == 0 and not last
        evaluating = t.val_loader is not None and ((tc.eval_every and t.step % tc.eval_every == 0) or last)
        if not (logged or saving or evaluating or last):
            continue
        # the step's one sync point: every value the host needs, in one read
        loss_sum, tokens, stopping, (norm, scale, n_skipped, streak, longest) = dp_totals(
            loss, pending_tokens, stop.set, rank, ops.cat([ops.stack([grad_norm, loss_scale]), skipped.counts]))
        skipped.read()
        update_check.verify(t.step)
        t.tokens_seen += tokens
        t.skipped_steps, t.bad_streak = t.skipped_steps + int(n_skipped), int(streak)
        pending_tokens = 0
        if n_skipped:
            rank.log(f"[train] {n_skipped:.0f} step(s) up to step {t.step} skipped: non-finite gradients (loss scale "
                     f"{scale:g})")
        ended_bad = last and t.bad_streak and not (t.scaler.enabled and np.isfinite(loss_sum))
        if longest >= tc.max_bad_steps or ended_bad:
            t.condemn_start_of_streak()
            rank.log(diverged_message(t.step, int(longest), scale, t.scaler.enabled, t.newest_healthy(),
                                      ended=bool(ended_bad) and longest < tc.max_bad_steps))
            return EXIT_DIVERGED
        record = reporter.step_record(t, loss_sum / scale, lr, norm, scale) if logged else {"step": t.step}
        if evaluating:
            record.update(evaluate(t))  # ZeRO-3: each layer gathered in its forward, every DP rank in step
            better = record["eval_loss"] < t.best_eval * (1 - EVAL_MIN_GAIN)
            t.best_eval, t.evals_without_gain = (record["eval_loss"], 0) if better else \
                (t.best_eval, t.evals_without_gain + 1)
        reporter.write(record, t.total_steps)
        if tc.early_stop_patience and t.evals_without_gain >= tc.early_stop_patience:
            rank.log(f"[train] early stop at step {t.step}: no better eval loss than {t.best_eval:.4f} in "
                     f"{t.evals_without_gain} evaluations (train.early_stop_patience)")
            return 0
        healthy = not t.bad_streak  # a checkpoint holds only healthy weights
        if (saving or stopping) and not healthy:
            rank.log(f"[train] no checkpoint at step {t.step}: the last {t.bad_streak} steps had non-finite "
                     f"gradients; the newest healthy one is {t.newest_healthy() or 'none'}")
        elif saving or stopping:
            t.save()
        if stopping:
            rank.log(f"[train] stop requested: {'checkpoint' if healthy else 'no checkpoint'} at step {t.step} "
                     "written, exiting")
            return EXIT_STOPPED
    return 0


def diverged_message(step: int, bad: int, loss_scale: float, scaled: bool, healthy: Path | None,
                     ended: bool = False) -> str:
    """Why the run stopped and what usually causes it (``ended``: it reached its last step in the bad streak)."""
    causes = "a learning rate too high for this model (train.lr), too little warmup (train.warmup_steps), " \
             "corrupt data (check the prepared samples)"
    if scaled:
        causes += ", fp16 overflow that loss scaling cannot absorb (train.precision=bf16 on Ascend)"
    found = f"up to its last step, {step}" if ended else f"found at step {step}"
    return (f"[train] error: {bad} consecutive steps with non-finite gradients, {found} (loss "
            f"scale {loss_scale:g}); stopping without a checkpoint or export. A rerun resumes "
            + (f"the newest healthy checkpoint, {healthy}" if healthy else "from step 0 (no healthy checkpoint)")
            + f" and diverges again unless a setting changes. Likely causes: {causes}. Raise train.max_bad_steps "
            "to tolerate longer runs of bad steps.")


def finish(t: Training, reporter: Reporter) -> int:
    """The end of a complete run: final checkpoint, Hugging Face export, summary; the exit code."""
    rank, run, recipe = t.rank, t.run, t.recipe
    bad = t.nonfinite_weights()
    if all_reduce_sum(ms.Tensor(np.array([len(bad)], np.float32)), rank.world_group).asnumpy()[0] > 0:
        rank.log(f"[train] error: non-finite weights{' in ' + ', '.join(bad[:3]) if bad else ''} at step {t.step}: "
                 "no checkpoint or export written; lower train.lr or resume from an earlier checkpoint")
        return EXIT_DIVERGED
    # resumed from the final checkpoint with no step to train: an interrupted export is redone from it
    checkpoint = t.finished_at if t.finished_at == run.checkpoint(t.step) else t.save(finished=True)
    hf_dir = run.hf
    if recipe.export.enabled:
        from finetune.io.hf_io import NonFiniteWeights
        from jobspec.config import parse_size

        unexportable: NonFiniteWeights | None = None
        try:
            with t.host_weights():
                export_final(t, parse_size(recipe.export.shard_size))
        except NonFiniteWeights as e:  # LoRA merged weights, or the export dtype's range
            unexportable = e
            if rank.local_rank == 0:
                condemn(checkpoint, f"its weights are not exportable: {e}")
        # only DP rank 0's TP group exports: every rank learns whether it failed, and all exit with the same code
        if all_reduce_sum(ms.Tensor(np.array([unexportable is not None], np.float32)),
                          rank.world_group).asnumpy()[0] > 0:
            rank.log(f"[train] error: {unexportable} (step {t.step}; {checkpoint} marked unhealthy); lower train.lr, "
                     "or export.dtype=fp32 when the weights only overflow a 16-bit dtype")
            return EXIT_DIVERGED
        from finetune.generate import sample_check

        t.model.set_train(False)  # inference: no LoRA dropout (its masks drawn ahead have the training shape)
        # collective; tokenizer from the base (every node has it)
        sample_check(t.model, t.model_dir, recipe, rank, run.samples)
    barrier(rank)
    summary = reporter.close(t, str(checkpoint), str(hf_dir) if recipe.export.enabled else None)
    if summary is not None:
        drop = (1 - summary["last_loss"] / summary["first_loss"]) * 100 if summary["first_loss"] else 0.0
        rank.log(f"[train] done: {summary['steps']} steps, {summary['tokens']:,} tokens, loss "
                 f"{summary['first_loss']:.4f} -> {summary['last_loss']:.4f} ({drop:.0f}% lower), "
                 f"{summary['wall_time_s']:.0f}s; metrics in {run.metrics}, curve in {run.loss_plot}")
    return 0


def export_final(t: Training, shard_size: int) -> None:
    """The run's export: hf/, and for LoRA adapter/ in peft's format with hf/ the merged model (export.merge)."""
    rank, run, recipe = t.rank, t.run, t.recipe
    rank.log(f"[train] writing the Hugging Face model to {run.hf} ({recipe.export.dtype})")
    if recipe.train.method == "lora":
        from finetune.io.lora_io import export_lora

        export_lora(t.model, t.params, recipe.lora, t.model_dir, t.identity.get("model", ""), run, recipe.export.dtype,
                    shard_size, recipe.export.merge, rank)
        merged = f", merged model to {run.hf}" if recipe.export.merge else ""
        rank.log(f"[train] LoRA adapter written to {run.adapter}{merged}")
    else:
        from finetune.io.hf_io import export_hf

        export_hf(t.model, t.model_dir, run.hf, recipe.export.dtype, shard_size, rank)
        rank.log(f"[train] Hugging Face model written to {run.hf}")
