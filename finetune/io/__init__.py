"""What goes to and comes from disk: checkpoints, resharding, Hugging Face and PEFT directories."""
