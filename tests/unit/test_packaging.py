"""What an installed package holds: ``recipes/`` and ``conf/`` live at the repository's top level and
install inside the package (``splash_rollout.recipes``, ``splash_rollout.conf``), so a non-editable
install runs ``python -m splash_rollout.run +recipe=...`` from any directory. setuptools' own
``build_py`` lays out what a wheel would hold; every recipe module and every YAML must be there."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _files(top: str, suffix: str) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), top) for d, _, fs in os.walk(top) for f in fs
            if f.endswith(suffix) and "__pycache__" not in d}


def test_an_install_holds_the_recipes_and_the_hydra_config_inside_the_package(tmp_path):
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)], cwd=ROOT,
                   check=True, timeout=300, capture_output=True)
    installed = os.path.join(tmp_path, "splash_rollout")
    for source, inside, suffix in (("recipes", "recipes", ".py"), ("conf", "conf", ".yaml"), ("conf", "conf", ".py")):
        wanted = _files(os.path.join(ROOT, source), suffix)
        assert wanted, f"no {suffix} files under {source}/"
        missing = wanted - _files(os.path.join(installed, inside), suffix)
        assert not missing, f"not installed as splash_rollout/{inside}/: {sorted(missing)}"
    assert not os.path.exists(os.path.join(tmp_path, "recipes")) and not os.path.exists(os.path.join(tmp_path, "conf"))
    assert os.path.isfile(os.path.join(installed, "run.py"))  # the package itself, beside them
