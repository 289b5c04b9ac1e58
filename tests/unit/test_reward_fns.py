"""Reward functions: built-ins (math answer checker, exact match, chain, reasoning-gym), a user's
function by import path, batched calls, and errors that name the row and carry the traceback."""
from __future__ import annotations

import sys
import textwrap

import pytest

from splash_rollout.recipes.grpo.reward_fns import RewardError, RewardFnError, RewardFunction, RewardOptions
from splash_rollout.recipes.grpo.task_data import Example
from splash_rollout.recipes.grpo.verifiers import exact_match, last_boxed, math_answer, normalize_answer


def reward(fn, **kw):
    return RewardFunction(RewardOptions(**{"fn": fn, "batched": False, "correct_threshold": 1.0,
                                           "answer_weight": 0.5, "format_reward": 0.1, **kw}))


def ex(label, row=None, index=0):
    return Example([5, 6], row if row is not None else {"answer": label}, label, None, "train", index)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_rewards.py").write_text(textwrap.dedent("""
        def score(response, row, token_ids):
            return {"reward": float(response.strip() == str(row["answer"])), "length": float(len(token_ids))}
        def scores(responses, rows, token_ids):
            return [float(r == str(row["answer"])) for r, row in zip(responses, rows)]
        def explode(response, row, token_ids):
            if row["answer"] == 3:
                raise ZeroDivisionError("the user's bug")
            return 1.0
        def not_a_number(response, row, token_ids):
            return "high"
        def no_reward_key(response, row, token_ids):
            return {"score": 1.0}
        VALUE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_rewards"
    sys.modules.pop("user_rewards", None)


def test_math_answer_checker():
    assert last_boxed(r"so \boxed{\frac{1}{2}} and \boxed{x^{2}}") == "x^{2}"
    assert math_answer(r"the answer is \boxed{\frac{1}{2}}", "0.5") == 1.0
    assert math_answer("first 3, then 1,234.", 1234) == 1.0
    assert math_answer(r"$\boxed{ 7 }$ not 8", 7) == 1.0  # boxed wins over the last number
    assert math_answer("-4", "-4.0") == 1.0 and math_answer("12", 13) == 0.0 and math_answer("none", 1) == 0.0
    assert normalize_answer("2/4") == "1/2" and normalize_answer(r"\dfrac{6}{3}") == "2" and normalize_answer("x+1") == "x+1"


def test_exact_match_and_chain_builtins():
    assert exact_match("  Paris \n", "Paris") == 1.0 and exact_match("paris", "Paris") == 0.0
    r = reward("chain")
    out = r(["3+4=7#7", "3+4=8#8"], [ex(7, {"answer": 7, "solution": "3+4=7#7"})] * 2, [[1], [1]])
    assert out.reward == [1.0, 0.0] and out.correct == [True, False]


def test_user_function_by_path(user_module):
    r = reward(f"{user_module}:score")
    out = r(["3", "4"], [ex(3), ex(3)], [[9, 9], [9]])
    assert out.reward == [1.0, 0.0] and out.correct == [True, False] and out.extras == {"length": [2.0, 1.0]}
    batched = reward(f"{user_module}:scores", batched=True)
    assert batched(["3", "4", "5"], [ex(3), ex(4), ex(4)], [[], [], []]).reward == [1.0, 1.0, 0.0]


def test_unimportable_reward_fn_is_named(user_module):
    with pytest.raises(RewardFnError, match=r"cannot import 'no_such_module_xyz'.*PYTHONPATH"):
        reward("no_such_module_xyz:score")
    with pytest.raises(RewardFnError, match=r"has no attribute 'missing'"):
        reward(f"{user_module}:missing")
    with pytest.raises(RewardFnError, match=r"'VALUE' is a int, not a function"):
        reward(f"{user_module}:VALUE")
    with pytest.raises(RewardFnError, match=r"expected one of .* or 'package.module:function'"):
        reward("score")


def test_a_raising_reward_names_the_row_and_keeps_the_traceback(user_module):
    r = reward(f"{user_module}:explode")
    with pytest.raises(RewardError) as info:
        r(["a", "b"], [ex(1, index=4), ex(3, index=11)], [[], []])
    msg = str(info.value)
    assert "train row 11" in msg and "{'answer': 3}" in msg and "response 'b'" in msg
    assert "Traceback" in msg and "ZeroDivisionError: the user's bug" in msg and "user_rewards.py" in msg
    with pytest.raises(RewardError, match=r"(?s)probe call before training.*row 0"):
        r.probe(ex(3))


def test_rewards_that_are_not_numbers_are_refused(user_module):
    with pytest.raises(RewardError, match=r"train row 0: expected a finite number, got str 'high'"):
        reward(f"{user_module}:not_a_number")(["x"], [ex(1)], [[]])
    with pytest.raises(RewardError, match=r"needs a 'reward' entry, got keys \['score'\]"):
        reward(f"{user_module}:no_reward_key")(["x"], [ex(1)], [[]])
    with pytest.raises(RewardError, match=r"\(batched\): expected a list of 2 rewards, got str"):
        reward(f"{user_module}:not_a_number", batched=True)(["x", "y"], [ex(1), ex(2)], [[], []])
    with pytest.raises(RewardError, match=r"(?s)raised in a batched call over rows \[0, 1\].*AttributeError"):
        reward(f"{user_module}:score", batched=True)(["x", "y"], [ex(1), ex(2, index=1)], [[], []])


def test_reasoning_gym_verifier():
    import reasoning_gym

    entries = [dict(e) for e in reasoning_gym.create_dataset("basic_arithmetic", size=3, seed=5)]
    r = reward("reasoning_gym")
    good = [f"<answer>{e['answer']}</answer>" for e in entries]
    out = r(good + ["<answer>nonsense</answer>"], [ex(e["answer"], e) for e in entries + entries[:1]], [[]] * 4)
    assert out.reward[:3] == [1.0, 1.0, 1.0] and out.reward[3] < 1.0 and out.correct == [True] * 3 + [False]
