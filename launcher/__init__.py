"""Host side of ascend-finetune, once per node (the env contract: ``launcher.settings.ENV_CONTRACT``).

Imports jobspec only (never finetune or MindSpore): it resolves the plan and starts the ranks as processes.
"""
