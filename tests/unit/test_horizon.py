"""The policy's horizon: median residual decode length from the call's ended samples (Kaplan-Meier)."""
import numpy as np

from splash_rollout.scheduling.horizon import MIN_STOPS, residual_tokens


def test_the_cap_until_enough_samples_have_stopped():
    assert residual_tokens([5, 30], [112, 40], [12] * (MIN_STOPS - 1)).tolist() == [107, 10]


def test_median_residual_of_a_known_length_distribution():
    stops = np.arange(1, 101)  # lengths 1..100 all observed
    assert residual_tokens([0], [1000], stops).tolist() == [50]
    assert residual_tokens([80], [1000], stops).tolist() == [10]  # conditional on having reached 80
    assert residual_tokens([80], [85], stops).tolist() == [5]  # never past the request's own cap


def test_running_samples_count_as_at_least_their_current_length():
    stops = [10] * 20 + [60] * 10
    # 20 requests still running at 50 tokens: half of the group is known to be longer than 10
    running = residual_tokens([50] * 20 + [0], [112] * 21, stops)
    assert running[-1] == 60  # S(10) = 1 - 20/50 = 0.6, S(60) = 0: the median is 60
    # ignoring them (no censoring) would call the typical sample 10 tokens long
    assert residual_tokens([0], [112], stops, censored_lengths=[]).tolist() == [10]
    # past the last stop there is nothing to learn from: the cap
    assert residual_tokens([61], [112], stops).tolist() == [51]


def test_capped_samples_are_censored_not_stops():
    stops = [5] * 10
    assert residual_tokens([0], [40], stops, censored_lengths=[40] * 30).tolist() == [40]  # S(5) = 0.75
    assert residual_tokens([0], [40], stops).tolist() == [5]
