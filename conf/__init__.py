"""The Hydra config of ``python -m splash_rollout.run`` and ``python -m splash_rollout.serve`` (YAML only).

It lives at the repository's top level beside ``recipes/`` and is installed as ``splash_rollout.conf``
(setup.py maps the folder), so an installed package finds it wherever it runs: ``CONFIG_DIR``.
"""
import os

CONFIG_DIR = os.path.dirname(os.path.abspath(__file__))
"""The folder holding ``config.yaml``, ``serve.yaml`` and the groups."""
