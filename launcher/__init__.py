"""Host side of ascend-finetune (see launcher/__main__.py for the env contract)."""
