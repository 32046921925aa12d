"""``make eval``: lm-evaluation-harness's tasks, prompts and scoring on Hugging Face model directories
(tasks.py: the task definitions; loaders.py: the files per published layout; scoring.py: log-likelihoods and
generation; runner.py: one model's numbers; __main__.py: the command line and the before/after table)."""
