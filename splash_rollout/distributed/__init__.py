"""distributed layer of splash_rollout."""
