"""The simulator admits by the engine's growth estimate, retracts when real KV overflows, and the
policy's phase pricing adds up the steps it says it does."""
import math

import numpy as np
import pytest

from splash_rollout.scheduling.admission import AdmissionSettings
from splash_rollout.layout import Layout
from splash_rollout.scheduling import Deployment, LayoutPolicy, PolicyConfig, StepBatch, step_time
from splash_rollout.sim import SimConfig, Workload, simulate


@pytest.fixture(scope="module")
def dep():
    return Deployment.build("glm-5", "b200")


def test_optimistic_admission_holds_the_engines_estimate_not_the_cap(dep):
    pool = dep.pools[Layout.TP]
    cap_new = pool // 8
    work = Workload.make([1000] * 32, 8, cap_new)  # short answers under a large cap
    ratio = 0.7 - (0.7 - 0.1) / 200  # the first step has decayed the ratio once
    expected = 1000 + math.ceil(ratio * cap_new)
    r = simulate(work, dep, "tp", SimConfig(chunk_tokens=1 << 20))
    assert r.timeline[0]["batch_max"] == min(32, pool // expected)
    worst = simulate(work, dep, "tp", SimConfig(chunk_tokens=1 << 20, admission=AdmissionSettings(mode="worst_case")))
    assert worst.timeline[0]["batch_max"] == pool // (1000 + cap_new)
    assert r.tokens == worst.tokens == work.total_tokens and r.seconds < worst.seconds


def test_requests_that_outgrow_the_pool_are_retracted_and_still_finish(dep):
    pool = dep.pools[Layout.TP]
    cap_new = pool // 3  # three fit by the estimate (ratio <= 0.7), not at their cap
    work = Workload.make([1000] * 3, cap_new, cap_new)
    r = simulate(work, dep, "tp")
    assert r.retractions > 0
    assert r.tokens == work.total_tokens and np.isfinite(r.finish_time).all()
    worst = simulate(work, dep, "tp", SimConfig(admission=AdmissionSettings(mode="worst_case")))
    assert worst.retractions == 0 and worst.tokens == work.total_tokens


def test_phase_pricing_is_prefill_steps_then_decode_steps(dep):
    policy = LayoutPolicy(dep, PolicyConfig(price_phase=True))
    batch = StepBatch.make([3000] * 63 + [8192], [1] * 63 + [8192], np.arange(64) % dep.world_size)
    priced = policy.pricer.admitted_costs(batch)
    horizon, prefill_left = 100.0, 8192 * 5
    got = policy.pricer.phase_seconds_per_token(priced, batch, horizon, prefill_left)
    decode = StepBatch.make(batch.context, np.ones(64, dtype=np.int64), batch.owners)
    for layout, (cost, step, _) in priced.items():
        n_pre = 5  # 40,960 rows at 8,192 a step
        t_dec = step_time(layout, decode, dep.model, dep.profile, dep.sizes).seconds
        # the same work for every layout: the prompt rows and the horizon's decode rows
        want = (n_pre * cost.seconds + (horizon - n_pre) * t_dec) / (prefill_left + horizon * 64)
        assert got[layout] == pytest.approx(want, rel=1e-12), layout
    # with nothing left to prefill the phase is the batch decoding
    only = policy.pricer.phase_seconds_per_token(priced, batch, horizon, 0)
    assert only[Layout.TP] == pytest.approx(step_time(Layout.TP, decode, dep.model, dep.profile, dep.sizes).seconds / 64)


def test_phase_prefill_rate_is_the_full_budget_step_not_this_steps_admission(dep):
    from splash_rollout.scheduling.phase import owner_capped
    from splash_rollout.scheduling.admission_plan import Waiting, admit

    policy = LayoutPolicy(dep, PolicyConfig(price_phase=True))
    owners = np.arange(16) % dep.world_size
    # fifteen decoding and one prefilling a 2,048-row chunk on one owner
    batch = StepBatch.make([3000] * 15 + [2048], [1] * 15 + [2048], owners)
    hold = batch.context
    # each queued request is expected to outgrow every pool: nothing is admitted now
    waiting = Waiting.make([2048] * 8, [1 << 40] * 8, 2048 * 4 + 15, 1024)
    priced = policy.pricer.admitted_costs(batch, hold, waiting)
    assert all(a == 0 for _, _, a in priced.values())
    horizon, prefill_left = 50.0, 2048 * 8
    got = policy.pricer.phase_seconds_per_token(priced, batch, horizon, prefill_left, hold, waiting)
    assert all(cost.feasible for cost, _, _ in priced.values())
    for layout, (cost, _, _) in priced.items():
        full, _, added = admit(layout, batch, hold, waiting, 1 << 62, dep.world_size, dep.page_size)
        assert added == 3  # the budget's other 6,144 rows: three 2,048-row prompts
        n_pre = 2  # 16,384 rows at 8,192 a step
        if layout in (Layout.DP, Layout.DOP):
            # each owner prefills at most 8,207 // 8 = 1,025 rows a step; owner 7 (the least
            # projected KV) holds the running prefill and gets the first admitted prompt, which
            # waits behind it, so three owners prefill
            full, _ = owner_capped(full, 1025)
            assert full.query_rows[full.query_rows > 1].tolist() == [1025] * 3
            # the two admitted chunks attend, halfway through their prompts, to (2,048 + 1,025) // 2
            context = full.context.copy()
            context[-2:] = 1536
            full = StepBatch.make(context, full.query_rows, full.owners)
            n_pre = 6  # 16,384 rows at 3,075 a step
        t_pre = step_time(layout, full, dep.model, dep.profile, dep.sizes).seconds
        decode = StepBatch.make(batch.context, np.ones(16, dtype=np.int64), owners)
        t_dec = step_time(layout, decode, dep.model, dep.profile, dep.sizes).seconds
        want = (n_pre * t_pre + (horizon - n_pre) * t_dec) / (prefill_left + horizon * 16)
        assert got[layout] == pytest.approx(want, rel=1e-12), layout


def test_the_phase_prefills_the_queue_that_enters_within_the_horizon():
    from splash_rollout.scheduling.phase import prefill_in_phase

    left = np.array([100, 50])  # two running prefills
    residual = np.array([10, 20, 30, 400, 500])  # median 30: three finish within the horizon
    queue = np.array([1000, 2000, 3000, 4000, 5000, 6000])
    # a slot free now (max_running 6, 5 running) and three that free: the queue's first four enter,
    # the first at once beside the running prefills, the other three one per finish
    got = prefill_in_phase(left, residual, queue, 6, 0.5)
    assert (got.now_rows, got.now_requests, got.later_rows, got.later_requests) == (150 + 1000, 1, 2000 + 3000 + 4000, 3)
    assert got.rows == 150 + 1000 + 2000 + 3000 + 4000
    # no slot free, three finish but only two are queued
    got = prefill_in_phase(left, residual, queue[:2], 5, 0.5)
    assert (got.now_rows, got.now_requests, got.later_rows, got.later_requests) == (150, 0, 3000, 2)
