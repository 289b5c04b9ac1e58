"""The OpenAI-compatible server (``python -m splash_rollout.serve``; the ``serve`` extra)."""
