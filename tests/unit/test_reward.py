"""The arithmetic-chain verifier and task generator."""
import collections

from splash_rollout.recipes.grpo.data import ChainTaskConfig, make_dataset, sample_chain
from splash_rollout.recipes.grpo.reward import parse_answer, score


def test_parse_answer():
    assert parse_answer("3+4=7,7-2=5#5") == 5
    assert parse_answer("#12") == 12 and parse_answer("x#-3") == -3
    assert parse_answer("3+4=7") is None and parse_answer("#5 extra") is None and parse_answer("#") is None
    assert parse_answer("#1#2") == 2


def test_score_levels():
    assert score("3+4=7#7", 7) == 1.0
    assert score("3+4=8#8", 7) == 0.1
    assert score("3+4=8#8", 7, format_reward=0.0) == 0.0
    assert score("garbage", 7) == 0.0


def test_reference_solutions_score_one_and_are_consistent():
    ds = make_dataset(300, seed=0)
    for row in ds:
        assert score(row["solution"], row["answer"]) == 1.0
        assert row["solution"].count("=") == row["num_steps"]
        assert eval(row["prompt"][:-2]) == row["answer"]  # the expression really evaluates to the answer


def test_values_stay_in_range_and_lengths_have_a_long_tail():
    task = ChainTaskConfig(max_value=9)
    ds = make_dataset(2000, seed=1, task=task)
    for sol in ds["solution"][:200]:
        for step in sol.split("#")[0].split(","):
            assert 0 <= int(step.split("=")[1]) <= 9
    counts = collections.Counter(ds["num_steps"])
    assert counts[1] > 5 * counts[12] > 0  # power law: short chains dominate, long ones exist


def test_deterministic():
    assert make_dataset(20, seed=3)["prompt"] == make_dataset(20, seed=3)["prompt"]
    import random
    assert sample_chain(random.Random(0), ChainTaskConfig()) == sample_chain(random.Random(0), ChainTaskConfig())


def test_chain_score_hand_computed():
    from splash_rollout.recipes.grpo.reward import chain_score

    ref = "3+4=7,7-2=5,5+1=6#6"
    assert chain_score(ref, 6, ref) == 1.0
    assert chain_score("3+4=7,7-2=5,5+1=6#6", 6, ref, answer_weight=0.8) == 1.0
    # right answer, one of three steps wrong: 0.5 + 0.5 * 2/3
    assert abs(chain_score("3+4=7,7-2=4,5+1=6#6", 6, ref) - (0.5 + 0.5 * 2 / 3)) < 1e-12
    # skipped steps: only the first matches, answer right
    assert abs(chain_score("3+4=7#6", 6, ref) - (0.5 + 0.5 / 3)) < 1e-12
    # steps shifted by one position count as wrong; garbage scores 0
    assert chain_score("0+3=3,3+4=7,7-2=5,5+1=6#6", 6, ref) == 0.5
    assert chain_score("garbage", 6, ref) == 0.0
    # extra steps beyond the reference are not rewarded, and the answer must be right
    assert abs(chain_score("3+4=7,7-2=5,5+1=6,6+0=6#7", 6, ref) - 0.5) < 1e-12
