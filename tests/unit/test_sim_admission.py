"""The simulator admits by the engine's growth estimate, retracts when real KV overflows, and the
policy's phase pricing adds up the steps it says it does."""
import math

import numpy as np
import pytest

from splash_rollout.engine.admission import AdmissionSettings
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
    priced = policy.admitted_costs(batch)
    horizon, prefill_left = 100.0, 8192 * 5
    got = policy.phase_seconds_per_token(priced, batch, horizon, prefill_left)
    decode = StepBatch.make(batch.context, np.ones(64, dtype=np.int64), batch.owners)
    for layout, (cost, step, _) in priced.items():
        n_pre = 5  # 40,960 rows at 8,192 a step
        t_dec = step_time(layout, decode, dep.model, dep.profile, dep.sizes).seconds
        want = (n_pre * cost.seconds + (horizon - n_pre) * t_dec) / (n_pre * step.rows + (horizon - n_pre) * 64)
        assert got[layout] == pytest.approx(want, rel=1e-12), layout
    # with nothing left to prefill the phase is the batch decoding
    only = policy.phase_seconds_per_token(priced, batch, horizon, 0)
    assert only[Layout.TP] == pytest.approx(step_time(Layout.TP, decode, dep.model, dep.profile, dep.sizes).seconds / 64)
