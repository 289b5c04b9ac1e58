"""Hand-computed cases for the benchmarks' own accounting (what their JSON reports is read against)."""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))

import long_tail_rl  # noqa: E402
import memory  # noqa: E402
import peer_engines  # noqa: E402


def test_full_group_pages_hold_the_full_prompt_pages_once():
    # prompt 40 tokens, pages of 16: 2 full prompt pages shared; each sample owns the partly filled
    # third prompt page and its response pages: ceil(40/16)=3, ceil(50/16)=4, ceil(70/16)=5
    assert memory.full_group_pages(40, [0, 10, 30], 16) == {"shared": 2 + 1 + 2 + 3, "unshared": 3 + 4 + 5}
    bound = memory.full_group_bound([{"shared": 8, "unshared": 12}, {"shared": 1, "unshared": 4}])
    assert bound["ratio_of_sums"] == 9 / 16 and bound["max_group_ratio"] == 8 / 12
    assert bound["groups_at_or_below_0.25"] == 0.5


def test_tail_seconds_counts_time_at_a_small_batch(tmp_path):
    call = {"phases": [{"t_end": 2.0, "tokens": 100, "batch_curve": [[0.0, 8], [1.0, 8], [2.0, 4]]},
                       {"t_end": 6.0, "tokens": 20, "batch_curve": [[2.0, 4], [3.0, 1], [6.0, 0]]}]}
    with open(tmp_path / "timeline.json", "w") as f:
        json.dump({"steps": [call, call]}, f)
    out = long_tail_rl.tail_seconds(str(tmp_path))  # batch <= 1 of a peak of 8: from t = 3 to 6
    assert out["tail_s"] == 6.0 and out["engine_s"] == 12.0 and out["rows"] == 240
    assert out["tail_s_by_step"] == [3.0, 3.0]


def test_peer_ratios_pair_each_round_with_its_own_base_run():
    def arm(rates):
        ok = [r for r in rates if r is not None]
        return {"median_tokens_per_s": peer_engines.median(ok),
                "rounds": [{"round": i, "tokens_per_s": r} for i, r in enumerate(rates)]}
    # slow stretches hit the base in round 1 and the arm in round 2: each round's pair still reads 1.1x
    # where it ran alone; the ratio of the medians (660 / 1000) pairs runs from different rounds
    base, arm_b = arm([1000.0, 600.0, 1000.0]), arm([1100.0, 660.0, 640.0])
    out = peer_engines.ratios(arm_b, base)
    assert [round(x, 12) for x in out["by_round"]] == [1.1, 1.1, 0.64]
    assert abs(out["median_by_round"] - 1.1) < 1e-12 and abs(out["of_medians"] - 0.66) < 1e-12
    failed = peer_engines.ratios(arm([1100.0, None, 500.0]), base)  # a failed round is left out
    assert failed["by_round"][1] is None and abs(failed["median_by_round"] - 0.8) < 1e-12
