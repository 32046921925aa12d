"""Per-device memory estimate for a full fine-tune (pure Python; the launcher imports it).

Placeholder signature; the distributed-training work owns the real breakdown.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MemoryEstimate:
    """Bytes per device, by part."""

    weights: int
    grads: int
    master: int
    optimizer: int
    activations: int
    workspace: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.master + self.optimizer + self.activations + self.workspace

    def table(self) -> str:
        rows = [(k, getattr(self, k)) for k in ("weights", "grads", "master", "optimizer", "activations",
                                                 "workspace")] + [("total", self.total)]
        return "\n".join(f"{k:<12}{v / 2**30:10.2f} GiB" for k, v in rows)


def estimate_memory(model_config: dict, *, seq_len: int, micro_batch_size: int, tp: int = 1, dp: int = 1,
                    precision: str = "bf16", recompute: bool = True, shard_optimizer: bool = False,
                    vocab_parallel: bool = False) -> MemoryEstimate:
    """Predict bytes per device from a Hugging Face Qwen2 config dict and the layout."""
    raise NotImplementedError
