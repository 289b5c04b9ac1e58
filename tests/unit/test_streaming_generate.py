"""Streaming generate with a group filter and a target (over-sampling + dynamic filtering), one rank:
kept groups pass the filter, every prompt ends in exactly one of kept / filtered / aborted, the
counts in the metrics add up, and kept samples are what a plain call gives for the same seeds."""
from __future__ import annotations

import pytest
import torch

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams

# group i needs 4 + 5 i tokens: groups finish one after the other, the last at step 39
PROMPTS = [[5 + i, 6, 7] for i in range(8)]
PARAMS = [SamplingParams(n=3, max_new_tokens=4 + 5 * i, seed=11 + i, ignore_eos=True) for i in range(8)]


@pytest.fixture(scope="module")
def engine():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # one token a step (no speculation): the tests below name the step a call was cut at
    with RolloutEngine(EngineConfig(model="glm5-nano", num_pages=256, page_size=8, max_num_batched_tokens=128,
                                    speculation="off")) as e:
        yield e
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def plain(engine):
    return {g.prompt_index: [s.response_ids for s in g.samples] for g in engine.generate(PROMPTS, PARAMS).groups}


def indices(groups):
    return [g.prompt_index for g in groups]


def test_filter_and_target_stop_the_call(engine, plain):
    seen = []

    def odd_out(group):
        seen.append(group.prompt_index)
        assert all(s.finish_reason == "length" for s in group.samples)  # only whole groups are judged
        return group.prompt_index % 2 == 0

    batch = engine.generate(PROMPTS, PARAMS, on_group=odd_out, target_groups=2)
    assert seen == [0, 1, 2] and indices(batch.groups) == [0, 2] and indices(batch.filtered) == [1]
    assert indices(batch.aborted) == [3, 4, 5, 6, 7]
    # the rest was cut at the step boundary after group 2's last token (step 14), not run out
    assert all(s.finish_reason == "abort" and len(s.response_ids) == 14 for g in batch.aborted for s in g.samples)
    assert batch.metrics["perf/steps"] == 14
    m = batch.metrics
    assert (m["rollout/kept_groups"], m["rollout/filtered_groups"], m["rollout/aborted_groups"]) == (2, 1, 5)
    assert m["rollout/aborted_samples"] == 5 * 3
    for g in batch.groups + batch.filtered:
        assert [s.response_ids for s in g.samples] == plain[g.prompt_index]
    # an aborted sample's tokens are the prefix an uninterrupted one would have drawn
    assert batch.aborted[0].samples[0].response_ids == plain[3][0][:14]
    # the engine is empty and serves the next call as usual
    assert {g.prompt_index: [s.response_ids for s in g.samples] for g in engine.generate(PROMPTS, PARAMS).groups} \
        == plain


@pytest.mark.parametrize("poll_steps", [1, 7])
def test_every_prompt_is_accounted_for(engine, poll_steps):
    rejected = {0, 3, 4}
    batch = engine.generate(PROMPTS, PARAMS, on_group=lambda g: g.prompt_index not in rejected, target_groups=3,
                            poll_steps=poll_steps)
    kept, filtered, aborted = indices(batch.groups), indices(batch.filtered), indices(batch.aborted)
    assert len(kept) == 3 and not set(kept) & rejected
    assert sorted(kept + filtered + aborted) == list(range(8))
    assert set(filtered) <= rejected
    assert batch.metrics["rollout/kept_groups"] + batch.metrics["rollout/filtered_groups"] \
        + batch.metrics["rollout/aborted_groups"] == len(PROMPTS)
    if poll_steps == 1:
        assert (kept, filtered, aborted) == ([1, 2, 5], [0, 3, 4], [6, 7])


def test_filter_fewer_than_target_runs_to_the_end(engine, plain):
    batch = engine.generate(PROMPTS, PARAMS, on_group=lambda g: g.prompt_index == 7, target_groups=4)
    assert indices(batch.groups) == [7] and indices(batch.filtered) == [0, 1, 2, 3, 4, 5, 6] and not batch.aborted
    assert batch.metrics["rollout/aborted_samples"] == 0


def test_target_without_filter_keeps_the_first_groups(engine):
    batch = engine.generate(PROMPTS, PARAMS, target_groups=3)
    assert indices(batch.groups) == [0, 1, 2] and not batch.filtered and indices(batch.aborted) == [3, 4, 5, 6, 7]


def test_a_raising_filter_leaves_the_engine_empty(engine, plain):
    def boom(group):
        raise RuntimeError("reward service down")

    with pytest.raises(RuntimeError, match="reward service down"):
        engine.generate(PROMPTS, PARAMS, on_group=boom)
    assert not engine.local_engine.scheduler.has_unfinished
    assert [s.response_ids for s in engine.generate(PROMPTS[:1], PARAMS[0]).groups[0].samples] == plain[0]


@pytest.mark.parametrize("kwargs, match", [({"on_group": 3}, "on_group: expected a callable"),
                                           ({"target_groups": 0}, "target_groups: expected an integer >= 1"),
                                           ({"target_groups": 9}, "target_groups: 9 is more than the call's 8"),
                                           ({"target_groups": 2, "poll_steps": 0}, "poll_steps: expected")])
def test_bad_stream_arguments(engine, kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        engine.generate(PROMPTS, PARAMS, **kwargs)
