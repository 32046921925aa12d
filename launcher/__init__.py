"""Host side of ascend-finetune (the env contract: ``launcher.settings.ENV_CONTRACT``)."""
