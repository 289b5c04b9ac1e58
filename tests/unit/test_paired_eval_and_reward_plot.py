"""What a GRPO run with held-out eval leaves at its end, without running one: the paired after-vs-
before comparison (summary.json's ``eval/paired``) from eval_correct.jsonl, and reward.png."""
import json

import pytest

from splash_rollout.recipes.grpo.evaluation import paired_comparison, wilson_interval
from splash_rollout.recipes.grpo.loop import paired_eval
from splash_rollout.recipes.grpo.plots import moving_average, plot_reward

PAIRED_KEYS = {"accuracy_before", "accuracy_after", "gained", "lost", "p_value", "prompts"}


def test_paired_comparison_counts_gained_and_lost_prompts():
    before = [0, 0, 0, 0, 0, 0, 1, 1]
    after = [1, 1, 1, 1, 1, 0, 1, 0]
    out = paired_comparison(before, after)
    assert set(out) == PAIRED_KEYS
    assert (out["gained"], out["lost"], out["prompts"]) == (5, 1, 8)
    assert out["accuracy_before"] == 0.25 and out["accuracy_after"] == 0.75
    assert out["p_value"] == pytest.approx(2 * (1 + 6) / 64)  # 2 * P(X <= 1), X ~ Bin(6, 1/2)
    with pytest.raises(ValueError, match="same prompts"):
        paired_comparison([1, 0], [1])


def test_wilson_interval_brackets_the_accuracy():
    low, high = wilson_interval(64, 128)
    assert low < 0.5 < high and high - low == pytest.approx(2 * 0.0853, abs=2e-3)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0


def test_paired_eval_and_reward_png_from_a_run_dir(tmp_path):
    path = tmp_path / "eval_correct.jsonl"
    rows = [(0, [0, 0, 1, 1]), (2, [1, 0, 1, 1]), (4, [1, 1, 1, 0])]
    path.write_text("".join(json.dumps({"grpo_step": s, "correct": c}) + "\n" for s, c in rows))
    paired = paired_eval(str(path), last_step=4)  # the first eval (after SFT) vs the one after step 4
    assert paired == {"accuracy_before": 0.5, "accuracy_after": 0.75, "gained": 2, "lost": 1, "p_value": 1.0,
                      "prompts": 4}
    assert paired_eval(str(path), last_step=6) is None  # no eval after the last step: no comparison
    history = [{"grpo_step": float(s), "reward/mean": 0.3 + 0.1 * s, "reward/accuracy": 0.1 * s} for s in range(4)]
    history[0].update({"eval/accuracy": 0.5, "eval/accuracy_low": 0.2, "eval/accuracy_high": 0.8,
                       "eval/num_prompts": 4.0})
    history.append({"grpo_step": 4.0, "eval/accuracy": 0.75, "eval/accuracy_low": 0.3, "eval/accuracy_high": 0.95})
    png = plot_reward(str(tmp_path / "reward.png"), history, window=2, paired=paired)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert moving_average([1.0, 3.0, 5.0], 2) == [1.0, 2.0, 4.0]
