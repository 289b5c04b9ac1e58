"""models layer of splash_rollout."""
