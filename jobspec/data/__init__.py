"""Training data: formats (instructions, tool calls, plain text), Qwen2.5 template and labels,
cleaning, token cache, training and validation batches.

Pure Python + numpy/tokenizers/pyarrow (no mindspore): the launcher runs prepare-data on the host.
"""
