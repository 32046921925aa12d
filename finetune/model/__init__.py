"""The network: the decoder (Qwen2/Qwen3 dense), its fused-kernel ops, LoRA adapters."""
