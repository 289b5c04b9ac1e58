"""Fleet placement: prefix affinity first, then load, ties round robin (splash_rollout/fleet/placement.py)."""
import pytest

from splash_rollout.fleet.placement import Placement, PlacementOptions


def fleet_of(n, **options):
    p = Placement(PlacementOptions(**options))
    for r in range(n):
        p.add(r)
    return p


def test_an_idle_fleet_spreads_distinct_prompts_and_then_the_least_loaded_wins():
    p = fleet_of(3)
    picks = []
    for i in range(3):
        picks.append(p.pick([i] * 10))
        p.started(picks[-1], [i] * 10, 1)
    assert sorted(picks) == [0, 1, 2]
    p.started(0, [99], 4)
    p.ended(1, 1)
    assert p.pick([7] * 10) == 1


def test_a_prompt_extending_an_earlier_one_follows_it_unless_that_replica_is_too_busy():
    p = fleet_of(2, block_tokens=4, max_imbalance=2)
    history = list(range(10))
    p.started(1, history, 1)
    assert p.pick(history + [50, 51]) == 1  # its first full blocks were sent to 1
    assert p.pick(history[:3] + [77] * 5) == 0  # shares less than a block: by load
    p.started(1, [5], 3)  # replica 1: 4 in flight, replica 0: none -> beyond the imbalance
    assert p.pick(history + [50, 51]) == 0


def test_the_longest_remembered_prefix_wins_and_a_removed_replica_is_forgotten():
    p = fleet_of(3, block_tokens=2)
    p.started(0, [1, 2, 3, 4], 1)
    p.started(2, [1, 2, 8, 8], 1)  # the first block was last sent to 2, the longer [1, 2, 3, 4] to 0
    assert p.pick([1, 2, 3, 4, 5]) == 0
    assert p.pick([1, 2, 9]) == 2
    p.remove(0)
    assert p.pick([1, 2, 3, 4, 5]) == 2 and 0 not in p.load
    p.remove(1)
    p.remove(2)
    with pytest.raises(RuntimeError, match="no replica is left"):
        p.pick([1])


def test_the_prefix_memory_is_bounded_and_options_are_checked():
    p = fleet_of(1, block_tokens=1, max_prefixes=5)
    p.started(0, list(range(20)), 1)
    assert len(p._sent) == 5
    with pytest.raises(ValueError, match="placement.block_tokens"):
        PlacementOptions(block_tokens=0)
    with pytest.raises(ValueError, match="placement.max_imbalance"):
        PlacementOptions(max_imbalance=-1)
