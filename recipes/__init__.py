"""Training loops that use RolloutEngine (GRPO first); each reads like its algorithm."""
