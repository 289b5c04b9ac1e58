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
    # past every observation the survival continues at the hazard of the later half [30.5, 61]: the
    # 10 stops at 60 over 10 * 29.5 + 30.5 tokens at risk; the request at 61 gets ln 2 / h = 22.6
    assert residual_tokens([61], [112], stops).tolist() == [23]


def test_capped_samples_are_censored_not_stops():
    stops = [5] * 10
    assert residual_tokens([0], [40], stops, censored_lengths=[40] * 30).tolist() == [40]  # S(5) = 0.75
    assert residual_tokens([0], [40], stops).tolist() == [5]


def test_the_tail_past_every_observation_by_hand():
    # 8 stops at 10 tokens, 10 requests running at 20 (cap 120) and one queued at 0
    got = residual_tokens([0] + [20] * 10, [120] * 11, [10] * 8)
    # at risk at 10: 8 stops + 10 running = 18, S(10) = 10/18; nothing is seen past 20 (t_max). The
    # later half [10, 20] holds the 8 stops over 10 * 10 tokens at risk: h = 0.08, and past 20
    # S(t) = S(10) exp(-0.08 (t - 20))
    # queued (S(0) = 1): S(t*) = 1/2 at t* = 20 + ln(1 / 0.9) / 0.08 = 21.3
    # running (S(20) = 10/18): S(t*) = 5/18 at t* = 20 + ln 2 / 0.08 = 28.7, residual 8.7
    assert got.tolist() == [22] + [9] * 10


def test_a_request_that_outlives_every_stop_is_not_handed_the_whole_cap():
    stops = np.arange(1, 101)
    # ages 300-500 with every stop at or below 100: no stop in the later half [250, 500], so the
    # hazard is the whole range's, 100 stops over 5,050 + 1,200 tokens at risk = 0.016; each request
    # is at S(t_max) and is given t* = 500 + ln 2 / 0.016 = 543.3 less its age
    ages = np.array([300, 400, 500])
    assert residual_tokens(ages, [1000] * 3, stops).tolist() == [244, 144, 44]
    # never past the request's own cap
    assert residual_tokens(ages, [320, 1000, 1000], stops).tolist() == [20, 144, 44]


def test_aging_past_the_last_stop_gives_the_tails_median_not_the_cap():
    stops = np.repeat(np.arange(10, 410, 10), 5)  # 200 stops, 10..400 tokens
    crowd = np.full(300, 200)  # requests running at 200 keep the curve populated
    probe = [int(residual_tokens(np.append(crowd, g), np.full(301, 4000), stops)[-1]) for g in range(380, 440)]
    # below 400 the next stops halve the few still at risk (the distance to them); from 400 on the
    # probe is the oldest observation and gets ln 2 / h of the later half [200, 400] (or of
    # [g / 2, g], as it ages): about 70 steps, where the cap alone would say 3,600
    assert probe[:20] == [10 - k % 10 for k in range(20)]
    assert all(60 <= r <= 75 for r in probe[20:]), probe
