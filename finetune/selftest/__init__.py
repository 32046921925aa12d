"""On-device self-test (issue 18 §2): every fused op the model calls at the real model's shapes, the
optimizer step, a tiny model's forward and backward and the node's collectives, each against an fp32
host reference at a stated tolerance (``python -m finetune.selftest``; ``python -m launcher selftest``).
On CPU the same checks run against the contract twins (:mod:`finetune.selftest.twins`)."""
