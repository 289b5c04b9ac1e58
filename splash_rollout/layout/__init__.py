"""layout layer of splash_rollout (see DESIGN.md §2)."""
