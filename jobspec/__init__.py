"""The job's description, read by both sides: imports no MindSpore, nothing of finetune or launcher.

Recipe schema and parser (config, recipe_parse), the Qwen parameter layout (model_layout), the memory estimate,
the run directory, safetensors headers (hf_files), the tiny default model, host probes (cpus, native), the
per-rank process lifecycle and the host-side data pipeline (data/: prepare-data tokenizes on the host). The
launcher imports only this package; every rank (finetune) imports it too. tests/test_import_rules.py holds
the rule for every module.
"""
