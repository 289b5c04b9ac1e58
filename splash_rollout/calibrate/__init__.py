"""``python -m splash_rollout.calibrate``: measure this group's hardware profile θ (scheduling/profile.py)."""
