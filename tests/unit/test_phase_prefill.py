"""The phase's prefill rate comes from the admissions the phase will see: the free slots' prompts at
once, then the queued prompts one per finishing request, spread over the horizon -- not from the
free slots of the step the policy is consulted at."""
import math

import numpy as np
import pytest

from splash_rollout.layout import Layout
from splash_rollout.scheduling import Deployment, LayoutPolicy, PolicyConfig, StepBatch, step_time
from splash_rollout.scheduling.policy import PhasePrefill, Waiting, admit


@pytest.fixture(scope="module")
def dep():
    return Deployment.build("glm-5", "b200")


def test_short_prompts_arrive_at_their_rows_over_the_horizon():
    queue = Waiting.make([1000] * 2 + [2000] * 6, [10_000] * 8, 16_384, 1024)
    phase = PhasePrefill(now_rows=2000, now_requests=2, later_rows=12_000, later_requests=6)
    # six prompts over a 3-step horizon: two arrive per step, 4,000 rows a step beside 100 decode rows
    got, rows, more = phase.next_arrivals(queue, running=100, horizon=3.0)
    assert got.prompt.tolist() == [2000] * 6 and rows == 12_000 and not more
    assert got.token_budget == 100 + 4000
    # over a 60-step horizon they arrive one every ten steps: a step carries one prompt's worth
    got, _, _ = phase.next_arrivals(queue, running=100, horizon=60.0)
    assert got.token_budget == 100 + 2000


def test_a_prompt_longer_than_the_budget_is_its_own_run_at_the_full_budget():
    queue = Waiting.make([3000, 3000, 400_000, 300_000], [1 << 20] * 4, 16_384, 1024)
    phase = PhasePrefill(now_rows=0, now_requests=0, later_rows=706_000, later_requests=4)
    got, rows, more = phase.next_arrivals(queue, running=384, horizon=50.0)
    # the two short prompts come first; the long ones behind them are a phase of their own
    assert got.prompt.tolist() == [3000, 3000] and rows == 6000 and more
    assert got.token_budget == 384 + 3000  # two prompts over min(50 steps, 2): one a step
    behind = PhasePrefill(now_rows=6000, now_requests=2, later_rows=700_000, later_requests=2)
    got, rows, more = behind.next_arrivals(queue, running=384, horizon=50.0)
    assert got.prompt.tolist() == [400_000, 300_000] and rows == 700_000 and not more
    assert got.token_budget == 16_384


def test_phase_prefill_rejects_inconsistent_counts():
    with pytest.raises(ValueError, match="later_rows"):
        PhasePrefill(now_rows=0, later_rows=100, later_requests=0)
    with pytest.raises(ValueError, match="now_requests"):
        PhasePrefill(now_rows=0, now_requests=-1)


def test_phase_price_is_now_steps_then_arrival_steps_then_decode(dep):
    policy = LayoutPolicy(dep, PolicyConfig(price_phase=True))
    t = dep.world_size
    batch = StepBatch.make([3000] * 64, 1, np.arange(64) % t)  # 64 decoding, none prefilling
    hold = batch.context
    # one slot free now (max_seqs 65), then eight 2,048-row prompts as requests finish
    waiting = Waiting.make([2048] * 9, [4096] * 9, 64 + 16_384, 65)
    phase = PhasePrefill(now_rows=2048, now_requests=1, later_rows=8 * 2048, later_requests=8)
    horizon = 40.0
    priced = policy.admitted_costs(batch, hold, waiting)
    got = policy.phase_seconds_per_token(priced, batch, horizon, phase, hold, waiting)
    decode = StepBatch.make(batch.context, 1, batch.owners)
    for layout, (cost, _, _) in priced.items():
        if not cost.feasible:
            continue
        now, _, added = admit(layout, batch, hold, waiting, 1 << 62, t, dep.page_size)
        assert added == 1  # the free slot: one prompt, one step
        # eight prompts over a 40-step horizon arrive one per five steps: a step carries one prompt
        later = Waiting.make([2048] * 8, [4096] * 8, 64 + 2048, 64 + 8)
        arrive, _, _ = admit(layout, decode, decode.context, later, 1 << 62, t, dep.page_size)
        assert arrive.rows == 64 + 2048
        price = lambda s: step_time(layout, s, dep.model, dep.profile, dep.sizes).seconds  # noqa: E731
        seconds = 1 * price(now) + 8 * price(arrive) + (horizon - 9) * price(decode)
        work = 1 * now.rows + 8 * arrive.rows + (horizon - 9) * 64
        assert got[layout] == pytest.approx(seconds / work, rel=1e-12), layout


def test_the_phase_ends_where_a_run_of_long_prompts_begins(dep):
    policy = LayoutPolicy(dep, PolicyConfig(price_phase=True))
    t = dep.world_size
    batch = StepBatch.make([3000] * 64, 1, np.arange(64) % t)
    hold = batch.context
    # no slot free; four short prompts then a long one enter as requests finish
    waiting = Waiting.make([2048] * 4 + [300_000], [4096] * 4 + [301_000], 64 + 16_384, 64)
    phase = PhasePrefill(now_rows=0, now_requests=0, later_rows=4 * 2048 + 300_000, later_requests=5)
    priced = policy.admitted_costs(batch, hold, waiting)
    got = policy.phase_seconds_per_token(priced, batch, 100.0, phase, hold, waiting)
    decode = StepBatch.make(batch.context, 1, batch.owners)
    for layout, (cost, _, _) in priced.items():
        if not cost.feasible:
            continue
        later = Waiting.make([2048] * 4, [4096] * 4, 64 + 2048, 64 + 4)
        arrive, _, _ = admit(layout, decode, decode.context, later, 1 << 62, t, dep.page_size)
        # four arrival steps, and nothing after them: the long prompt is the next phase's
        want = step_time(layout, arrive, dep.model, dep.profile, dep.sizes).seconds / arrive.rows
        assert got[layout] == pytest.approx(want, rel=1e-12), layout


def test_an_int_still_means_every_row_starts_now(dep):
    policy = LayoutPolicy(dep, PolicyConfig(price_phase=True))
    batch = StepBatch.make([3000] * 63 + [8192], [1] * 63 + [8192], np.arange(64) % dep.world_size)
    priced = policy.admitted_costs(batch)
    as_int = policy.phase_seconds_per_token(priced, batch, 100.0, 8192 * 5)
    as_phase = policy.phase_seconds_per_token(priced, batch, 100.0, PhasePrefill(now_rows=8192 * 5))
    assert as_int == as_phase
    assert all(math.isfinite(v) for v in as_int.values())
