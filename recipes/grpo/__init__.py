"""GRPO on RolloutEngine: data (task + prompts), reward (verifier), loss, trainer, SFT warm start, loop."""
