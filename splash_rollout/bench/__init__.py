"""Measured benchmarks on this machine: ``python -m splash_rollout.bench VERB`` (JSON + PNG)."""
