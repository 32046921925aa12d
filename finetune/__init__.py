"""ascend-finetune worker side: runs inside every rank (model, data, optimizer, checkpoints, export).

Importing this package must not import mindspore: the launcher imports the pure-Python
modules (config, memory estimate) and must answer in a second.
"""
