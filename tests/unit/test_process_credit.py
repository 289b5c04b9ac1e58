"""Process supervision: the chain task's per-step scores, step -> token mapping, per-token
advantages (own step vs reward-to-go), the loss on per-token advantages, and bad "steps" rejected."""
from __future__ import annotations

import textwrap

import pytest
import torch

from splash_rollout.models.tokenizer import load_tokenizer
from splash_rollout.recipes.grpo.loss import grpo_loss
from splash_rollout.recipes.grpo.process_credit import (Supervision, process_advantages, steps_of_tokens,
                                                        token_starts)
from splash_rollout.recipes.grpo.reward import chain_steps
from splash_rollout.recipes.grpo.reward_fns import RewardError, RewardFunction, RewardOptions
from splash_rollout.recipes.grpo.task_data import Example

REF = "3+4=7,7-2=5,5+1=6#6"


def test_chain_steps_credit_stops_at_the_first_wrong_step():
    assert chain_steps(REF, 6, REF) == [(6, 1.0), (12, 1.0), (18, 1.0), (19, 1.0)]
    # step 2 wrong: it and every later step earn 0 even where they match; the answer is checked on its own
    assert chain_steps("3+4=7,7-2=4,5+1=6#6", 6, REF) == [(6, 1.0), (12, 0.0), (18, 0.0), (19, 1.0)]
    assert chain_steps("#6", 6, REF) == [(2, 1.0)]                          # answer only
    assert chain_steps("3+4=7,7-2=5", 6, REF) == [(6, 1.0), (11, 1.0), (11, 0.0)]  # stopped without answering
    assert chain_steps("", 6, REF) == [(0, 0.0)]
    assert chain_steps("3+4=7,7-2=5,5+1=6,6+0=6#6", 6, REF)[3] == (24, 0.0)  # a step past the reference's


def test_tokens_map_to_the_step_they_start_in():
    assert steps_of_tokens([0, 3, 5, 6, 11], [6, 11, 11]) == [0, 0, 0, 1, 2]  # past the last end: the last step
    tok = load_tokenizer("glm5-nano")
    ids = tok.encode("3+4=7,7-2=5#5") + [tok.eos_token_ids[0]]
    starts = token_starts(tok, ids)
    assert starts[:6] == [0, 1, 2, 3, 4, 5] and starts[-1] == len("3+4=7,7-2=5#5")


def test_process_advantages_own_step_and_to_go():
    steps = [[[(6, 1.0), (12, 1.0), (13, 1.0)], [(6, 1.0), (12, 0.0), (13, 0.0)]]]
    starts = [[[0, 6, 12], [0, 6, 12]]]
    (right, wrong), = process_advantages(steps, starts, "step", eps=0.0)
    # group step rewards 1,1,1,1,0,0: mean 2/3, std sqrt(2)/3
    hi, lo = (1 - 2 / 3) / (2 ** 0.5 / 3), (0 - 2 / 3) / (2 ** 0.5 / 3)
    assert right == pytest.approx([hi, hi, hi]) and wrong == pytest.approx([hi, lo, lo])
    (right, wrong), = process_advantages(steps, starts, "to_go", eps=0.0)
    assert right == pytest.approx([3 * hi, 2 * hi, hi]) and wrong == pytest.approx([hi + 2 * lo, 2 * lo, lo])
    (a, b), = process_advantages([[[(3, 1.0)], [(3, 1.0)]]], [[[0, 1], [0]]], "step")
    assert a == [0.0, 0.0] and b == [0.0]                                   # no spread, no signal
    with pytest.raises(ValueError, match="process_credit"):
        process_advantages(steps, starts, "sum")


def test_per_token_advantages_equal_per_sample_ones_when_constant():
    torch.manual_seed(0)
    lp, old = torch.randn(3, 5), torch.randn(3, 5)
    mask = torch.ones(3, 5)
    adv = torch.tensor([0.5, -1.0, 2.0])
    per_sample, _ = grpo_loss(lp, old, adv, mask)
    per_token, _ = grpo_loss(lp, old, adv.unsqueeze(-1).expand(3, 5), mask)
    assert torch.allclose(per_sample, per_token)


def _reward(fn):
    return RewardFunction(RewardOptions(fn=fn, batched=False, correct_threshold=1.0, answer_weight=0.5,
                                        format_reward=0.1))


def test_chain_reward_returns_steps_and_bad_user_steps_are_named(tmp_path, monkeypatch):
    ex = Example([5], {"answer": 6, "solution": REF}, 6, None, "train", 4)
    scored = _reward("chain")([REF, "#5"], [ex, ex], [[], []])
    assert scored.steps == [chain_steps(REF, 6, REF), [(2, 0.0)]]
    assert scored.extras["answered"] == [1.0, 1.0] and _reward("chain")(["3+4=7"], [ex], [[]]).extras["answered"] == [0.0]
    (tmp_path / "bad_steps.py").write_text(textwrap.dedent("""
        def backwards(response, row, token_ids):
            return {"reward": 1.0, "steps": [(3, 1.0), (1, 0.0)]}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match=r"train row 4: \['steps'\]\[1\]: end must be .*\[3, 5\]"):
        _reward("bad_steps:backwards")(["12345"], [ex], [[]])


def test_process_supervision_needs_steps():
    sup = Supervision("process")
    rewards = _reward("answer")(["#6"], [Example([5], {"answer": 6}, 6, None, "train", 0)], [[]])
    with pytest.raises(ValueError, match="'steps'"):
        sup.advantages(torch.zeros(1, 1), rewards, None, None)
    with pytest.raises(ValueError, match="grpo.supervision"):
        Supervision("dense")
