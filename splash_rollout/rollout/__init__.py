"""rollout layer of splash_rollout."""
