"""Nothing lost on one rank: every submitted sample comes back exactly once with a finish
reason that fits its tokens, whatever the request mix and wherever an abort lands, and no KV page is
held after any call (50 calls, 10 sleep/wake cycles: no growth). The 2-rank version, with switch schedules, is in
tests/distributed/test_reliability.py.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams
from splash_rollout.models.config import PRESETS
from tests.rollout_checks import assert_every_sample_once, assert_only_cache_holds_pages

MAX_LEN = 48


@pytest.fixture(scope="module")
def engine():
    with RolloutEngine(EngineConfig(model="glm5-nano", num_pages=48, page_size=4, max_model_len=MAX_LEN,
                                    max_num_batched_tokens=48, max_num_seqs=6)) as eng:
        yield eng


def assert_nothing_held(eng: RolloutEngine) -> None:
    placement = eng.local_engine.scheduler.placement
    assert not eng.local_engine.scheduler.has_unfinished
    assert_only_cache_holds_pages(placement.managers)
    assert placement.projected_tokens == [0]


request = st.tuples(st.integers(1, 40), st.integers(1, 3), st.integers(1, 16), st.integers(0, 80),
                    st.integers(0, 511), st.booleans(), st.sampled_from([0.0, 1.0]))


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(reqs=st.lists(request, min_size=1, max_size=6), abort_at=st.none() | st.integers(0, 10), data=st.data())
def test_every_sample_comes_back_once_whatever_the_mix_and_aborts(engine, reqs, abort_at, data, monkeypatch_step):
    prompts = [data.draw(st.lists(st.integers(0, 511), min_size=n, max_size=n)) for n, *_ in reqs]
    params = [SamplingParams(n=n, max_new_tokens=new, stop_token_ids=tuple(range(lo, min(512, lo + width))),
                             ignore_eos=ignore, temperature=temp)
              for (_, n, new, width, lo, ignore, temp) in reqs]
    monkeypatch_step(engine, abort_at)
    batch = engine.generate(prompts, params)
    # the context (48) may end a sample before max_new_tokens: its reason is "length" all the same
    capped = [SamplingParams(n=p.n, max_new_tokens=min(p.max_new_tokens, MAX_LEN - len(x)),
                             stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos)
              for p, x in zip(params, prompts)]
    assert_every_sample_once(batch, prompts, capped, aborted_ok=abort_at is not None)
    event(f"finish reasons: {sorted({s.finish_reason for s in batch.samples})}")
    assert_nothing_held(engine)


@pytest.fixture
def monkeypatch_step(monkeypatch):
    """Make engine.abort() be called, as another thread would, just before step ``abort_at`` of the call."""
    def patch(eng: RolloutEngine, abort_at: int | None) -> None:
        local = eng.local_engine
        real = type(local)._step
        count = {"n": 0}

        def step(self, *args):
            if abort_at is not None and count["n"] == abort_at:
                assert eng.abort() > 0
            count["n"] += 1
            return real(self, *args)

        monkeypatch.setattr(local, "_step", step.__get__(local))
    return patch


def test_abort_lands_at_a_step_boundary_and_is_not_kept(engine, monkeypatch_step):
    params = SamplingParams(n=3, max_new_tokens=20, ignore_eos=True)  # all 6 fit the pool at once
    monkeypatch_step(engine, 4)
    batch = engine.generate([[3, 4, 5], [6] * 10], params)
    assert [s.finish_reason for s in batch.samples] == ["abort"] * 6
    assert [len(s.response_ids) for s in batch.samples] == [5] * 6  # steps 0-4 ran, each sampled a token
    assert_nothing_held(engine)
    monkeypatch_step(engine, None)
    assert engine.abort() == 0  # nothing running: nothing remembered
    again = engine.generate([[3, 4, 5]], params)
    assert [(s.finish_reason, len(s.response_ids)) for s in again.samples] == [("length", 20)] * 3


def test_fifty_calls_leave_no_page_behind(engine):
    eos = PRESETS["glm5-nano"].eos_token_ids
    for call in range(50):
        batch = engine.generate([[3 + call] * (1 + call % 17), [7] * 5],
                                SamplingParams(n=1 + call % 3, max_new_tokens=1 + call % 7,
                                               stop_token_ids=tuple(range(100, 100 + 5 * (call % 4))),
                                               ignore_eos=call % 2 == 0))
        assert len(batch.samples) == 2 * (1 + call % 3)
        assert all(s.finish_reason in ("stop", "length") for s in batch.samples)
        assert all(s.finish_reason == "length" or s.response_ids[-1] in (*range(100, 120), *eos)
                   for s in batch.samples)
        assert_nothing_held(engine)


def test_ten_sleep_wake_cycles_leave_no_page_or_byte_behind(engine):
    params = SamplingParams(n=2, max_new_tokens=5, seed=3)
    want = [s.response_ids for s in engine.generate([[3, 4, 5], [6] * 7], params).samples]
    awake = engine.memory_stats()[0]
    for cycle in range(10):
        engine.sleep()
        assert engine.memory_stats()[0]["kv_pool"] == 0
        engine.wake_up()
        assert_nothing_held(engine)
        assert {k: engine.memory_stats()[0][k] for k in ("kv_pool", "weights")} == \
            {k: awake[k] for k in ("kv_pool", "weights")}
        assert [s.response_ids for s in engine.generate([[3, 4, 5], [6] * 7], params).samples] == want
        assert_nothing_held(engine)
