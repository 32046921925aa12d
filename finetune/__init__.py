"""ascend-finetune worker side: runs inside every rank (model, parallel layers, optimizer, checkpoints, export,
generation) and imports MindSpore where it computes.

It reads only the resolved plan (jobspec) and msrun's rank environment; it never imports launcher, and the
launcher never imports it (it starts its modules as processes). tests/test_import_rules.py holds the rule.
"""
