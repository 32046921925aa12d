"""What the loop reports at a sync point: the step record (loss, speed, MFU, time breakdown, memory),
the eval loss, and rank 0's outputs (metrics.jsonl, TensorBoard, the console, the end summary)."""
from __future__ import annotations

import time

import mindspore as ms

from finetune.dist import dp_totals
from finetune.run.memcheck import measured, memory_record, plan_estimate
from finetune.run.metrics import MetricsWriter, progress_line, read_metrics
from finetune.run.perf import StepTimer, device_peak_flops, flops_per_token, peak_memory_bytes
from finetune.run.summary import RunSummary, run_title
from finetune.run.training import Training, batch_tensors
from jobspec.data.template import IGNORE


def dp_sent_bytes(t: Training) -> int:
    """The bytes this rank has sent over DP so far (``Channel.sent``, finetune/transport.py: the optimizer's channel
    and, ZeRO-3 with LoRA, the frozen base's, ``zero3_lora.FrozenShards``); 0 without DP."""
    frozen = t.zero3.frozen if t.zero3 is not None else None
    channels = [t.reduction.opt.channel, frozen.channel if frozen is not None else None]
    return sum(int(c.sent) for c in channels if c is not None)

class Reporter:
    """Builds the records of one run; rank 0 writes them (other ranks compute the same numbers)."""

    def __init__(self, t: Training):
        rank, recipe = t.rank, t.recipe
        self.model_config = t.model.config.to_dict()
        self.flops_per_token = flops_per_token(self.model_config, recipe.data.seq_len)
        self.peak_flops, source = device_peak_flops(rank)
        rank.log(f"[train] MFU: {self.flops_per_token / 1e9:.3f} GFLOPs per token against {source}")
        self.timer = StepTimer()
        self.window = (time.time(), t.tokens_seen)  # start of the tokens/s window
        self.memory_checked = False
        self.metrics = self.report = None
        if rank.is_main:
            self.metrics = MetricsWriter(t.run.metrics, t.step)
            self.report = RunSummary(t.run, run_title(recipe, rank.tp, rank.dp, recipe.parallel.pp),
                                       recipe.train.tensorboard, t.step)

    def step_record(self, t: Training, loss: float, lr: float, grad_norm: float, loss_scale: float) -> dict:
        """The logged step's record: loss, lr, grad norm, tokens/s, MFU, time per phase, peak memory."""
        now = time.time()
        tokens_per_s = (t.tokens_seen - self.window[1]) / max(now - self.window[0], 1e-9)
        self.window = (now, t.tokens_seen)
        peak = peak_memory_bytes(t.rank.platform)
        record = {"step": t.step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
                  "elapsed_s": round(t.elapsed_s(), 3), "loss_scale": loss_scale, "peak_memory_bytes": peak,
                  "dp_sent_bytes": dp_sent_bytes(t),
                  **self.timer.report(t.reduction.take_comm_s())}
        if self.peak_flops:
            record["mfu"] = tokens_per_s * self.flops_per_token / (self.peak_flops * t.rank.world_size)
        if not self.memory_checked:  # step 1 (or the first logged step): the peak beside the plan's estimate
            self.memory_checked = True
            fields, line = memory_record(plan_estimate(t.run.plan, t.recipe, self.model_config), measured())
            record.update(fields)
            t.rank.log(line)
        return record

    def write(self, record: dict, total_steps: int) -> None:
        """Rank 0: append to metrics.jsonl and TensorBoard, print the progress (and eval) line."""
        if self.metrics is None or self.report is None:  # not rank 0 (both or neither)
            return
        self.metrics.write(record)
        self.report.write(record)
        if "loss" in record:
            print(progress_line(record, total_steps), flush=True)
        if "eval_loss" in record:
            print(f"[train] step {record['step']}: eval loss {record['eval_loss']:.4f} over "
                  f"{record['eval_tokens']:,} tokens", flush=True)

    def close(self, t: Training, checkpoint: str, export_path: str | None) -> dict | None:
        """Rank 0: flush TensorBoard, write summary.json and loss.png; the summary."""
        if self.report is None:
            return None
        return self.report.close(read_metrics(t.run.metrics), t.tokens_seen, t.elapsed_s(),
                                 last_checkpoint=checkpoint, export_path=export_path)


def evaluate(t: Training) -> dict:
    """Token-weighted mean loss over the whole validation set (each DP rank its share, summed over
    the ranks; ZeRO-3: every DP rank in step, each layer gathered in its forward): ``{"eval_loss", "eval_tokens"}``."""
    loss_sum, tokens = ms.Tensor(0.0, ms.float32), 0
    assert t.val_loader is not None  # called only with a validation set
    t.model.set_train(False)  # no backward follows: the LM head keeps no logits
    for mb in t.val_loader.eval_micro_batches(lockstep=t.zero3 is not None):
        loss_sum = loss_sum + t.model(*batch_tensors(mb))
        tokens += int((mb["labels"][:, 1:] != IGNORE).sum())
    t.model.set_train(True)
    total, count, _, _ = dp_totals(loss_sum, tokens, False, t.rank)
    return {"eval_loss": total / max(count, 1), "eval_tokens": count}
