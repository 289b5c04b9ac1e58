"""The paired held-out test of scripts/paired_eval.py: McNemar's exact p-value, by hand."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def paired_eval():
    spec = importlib.util.spec_from_file_location("paired_eval", os.path.join(ROOT, "scripts", "paired_eval.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("gained,lost,p", [
    (5, 0, 2 / 32),                      # all five discordant prompts one way: 2 * (1/2)^5
    (0, 5, 2 / 32),                      # symmetric
    (3, 1, 2 * (1 + 4) / 16),            # 2 * P(X <= 1), X ~ Bin(4, 1/2)
    (1, 1, 1.0),                         # no evidence either way (capped at 1)
    (0, 0, 1.0),                         # no discordant prompt
])
def test_mcnemar_exact_p(paired_eval, gained, lost, p):
    assert paired_eval.mcnemar_exact_p(gained, lost) == pytest.approx(p)


def test_a_folder_without_two_policies_is_refused(paired_eval, tmp_path):
    with pytest.raises(SystemExit, match="two policies"):
        paired_eval.policies(str(tmp_path))
