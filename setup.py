"""Packaging beyond pyproject.toml: the recipes and the Hydra config live at the repository's top
level (``recipes/``, ``conf/``) and install inside the package as ``splash_rollout.recipes`` and
``splash_rollout.conf``, so imports and an installed ``python -m splash_rollout.run`` find them from
any directory. Every subpackage is found here, none listed by hand."""
from setuptools import find_packages, setup

PACKAGES = find_packages(include=["splash_rollout", "splash_rollout.*"])
RECIPES = [f"splash_rollout.{name}" for name in find_packages(include=["recipes", "recipes.*"])]

setup(packages=PACKAGES + RECIPES + ["splash_rollout.conf"],
      package_dir={"splash_rollout.recipes": "recipes", "splash_rollout.conf": "conf"})
