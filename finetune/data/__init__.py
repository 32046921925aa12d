"""Instruction data: formats, Qwen2.5 template and labels, cleaning, token cache, batching.

Pure Python + numpy/tokenizers/pyarrow (no mindspore): the launcher runs prepare-data on the host.
"""
