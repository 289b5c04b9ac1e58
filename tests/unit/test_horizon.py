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
    # past every observation the tail prior takes over: S falls linearly to 0 at the cap, so a
    # request at 61 (the longest length seen) gets half of the 51 its cap leaves, rounded up
    assert residual_tokens([61], [112], stops).tolist() == [26]


def test_capped_samples_are_censored_not_stops():
    stops = [5] * 10
    assert residual_tokens([0], [40], stops, censored_lengths=[40] * 30).tolist() == [40]  # S(5) = 0.75
    assert residual_tokens([0], [40], stops).tolist() == [5]


def test_the_tail_prior_from_the_cap_by_hand():
    # 8 stops at 10 tokens, 10 requests running at 20 (cap 120) and one queued at 0
    got = residual_tokens([0] + [20] * 10, [120] * 11, [10] * 8)
    # at risk at 10: 8 stops + 10 running = 18, S(10) = 10/18; nothing is seen past 20 (t_max), where
    # S(t) = S(10) (120 - t) / (120 - 20)
    # queued (S(0) = 1): S(t*) = 1/2 at t* = 120 - 100 * 0.5 / (10/18) = 30
    # running (S(20) = 10/18): S(t*) = 5/18 at t* = 120 - 100 / 2 = 70, residual 70 - 20 = 50
    assert got.tolist() == [30] + [50] * 10


def test_a_request_that_outlives_every_stop_is_not_handed_the_whole_cap():
    stops = np.arange(1, 101)
    # aged 150 with nothing seen past its own age: half of what the cap leaves, not all of it
    assert residual_tokens([150], [1000], stops).tolist() == [425]
    # a crowd of running requests all past the last stop: each gets its share of the tail
    ages = np.array([300, 400, 500])
    got = residual_tokens(ages, [1000] * 3, stops)
    # S is flat at S(100) up to 500 (t_max); each has S(g) = S(100), so t* = 1000 - 500 / 2 = 750
    assert got.tolist() == (750 - ages).tolist()
