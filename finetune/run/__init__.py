"""The training run: its setup, the loop, step records, speed, memory check, summary."""
