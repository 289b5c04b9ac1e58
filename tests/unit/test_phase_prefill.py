"""The phase's prefill rate comes from the admissions the phase will see: the free slots' prompts at
once, then the queued prompts one per finishing request, spread over the horizon -- not from the
free slots of the step the policy is consulted at. Layouts that prefill on owners run at most
their per-owner share a step, and every layout is priced on the same work."""
import numpy as np
import pytest

from splash_rollout.layout import Layout
from splash_rollout.scheduling import Deployment, LayoutPolicy, PolicyConfig, StepBatch, step_time
from splash_rollout.scheduling.phase import (Arrivals, PhasePrefill, held_at_runs, mid_prefill, owner_capped,
                                             owner_pieces, prefill_step)
from splash_rollout.scheduling.admission_plan import Waiting, admit


@pytest.fixture(scope="module")
def dep():
    return Deployment.build("glm-5", "b200")


def kept_decode(dep, layout, batch, hold, waiting):
    """The decode step ``layout`` keeps running once its pool has taken the queue's head (every
    prompt prefilled), one row per request: the phase's decode rows run in steps of this batch."""
    unbounded = Waiting.make(waiting.prompt, waiting.reserved, 1 << 62, waiting.max_seqs)
    full, _, _ = admit(layout, batch, hold, unbounded, dep.pools[layout], dep.world_size, dep.page_size)
    return StepBatch.make(full.context, 1, full.owners)


def test_short_prompts_arrive_at_their_rows_over_the_horizon():
    prompt, reserved = np.array([1000] * 2 + [2000] * 6), np.full(8, 10_000)
    phase = PhasePrefill(now_rows=2000, now_requests=2, later_rows=12_000, later_requests=6)
    # six prompts over a 3-step horizon: two arrive per step, 4,000 rows a step beside 100 decode rows
    got = phase.next_arrivals(prompt, reserved, 16_384, running=100, horizon=3.0)
    assert got.prompt.tolist() == [2000] * 6 and got.rows == 12_000 and not got.long and not got.more
    assert got.token_budget == 100 + 4000
    # over a 60-step horizon they arrive one every ten steps: a step carries one prompt's worth
    got = phase.next_arrivals(prompt, reserved, 16_384, running=100, horizon=60.0)
    assert got.token_budget == 100 + 2000


def test_a_prompt_longer_than_the_budget_is_a_run_of_its_own_at_the_full_budget():
    prompt, reserved = np.array([3000, 3000, 400_000, 300_000]), np.full(4, 1 << 20)
    phase = PhasePrefill(now_rows=0, now_requests=0, later_rows=706_000, later_requests=4)
    got = phase.next_arrivals(prompt, reserved, 16_384, running=384, horizon=50.0)
    # the two short prompts come first; the long ones behind them are a phase of their own
    assert got.prompt.tolist() == [3000, 3000] and got.rows == 6000 and got.more and not got.long
    assert got.token_budget == 384 + 3000  # two prompts over min(50 steps, 2): one a step
    behind = PhasePrefill(now_rows=6000, now_requests=2, later_rows=700_000, later_requests=2)
    got = behind.next_arrivals(prompt, reserved, 16_384, running=384, horizon=50.0)
    assert got.prompt.tolist() == [400_000, 300_000] and got.rows == 700_000 and got.long and not got.more
    assert got.token_budget == 16_384


def test_phase_prefill_rejects_inconsistent_counts():
    with pytest.raises(ValueError, match="later_rows"):
        PhasePrefill(now_rows=0, later_rows=100, later_requests=0)
    with pytest.raises(ValueError, match="now_requests"):
        PhasePrefill(now_rows=0, now_requests=-1)


def test_owner_capped_gives_each_owner_its_share_fcfs():
    # owner 0: chunks of 1,500 and 1,000 (cap 2,000: 1,500 then 500); owner 1: 3,000 -> 2,000
    step = StepBatch.make([5000, 1500, 1000, 3000], [1, 1500, 1000, 3000], [0, 0, 0, 1])
    got, kept = owner_capped(step, 2000)
    assert kept.all() and got.query_rows.tolist() == [1, 1500, 500, 2000]
    assert got.context.tolist() == [5000, 1500, 500, 2000]
    # a chunk cut to no rows leaves the step
    got, kept = owner_capped(StepBatch.make([1500, 1000], [1500, 1000], [0, 0]), 1500)
    assert got.query_rows.tolist() == [1500] and kept.tolist() == [True, False]


def test_owner_pieces_and_mid_prefill():
    pieces, reserved = owner_pieces(np.array([2500, 1000]), np.array([9000, 4000]), 2048)
    assert pieces.tolist() == [2048, 452, 1000] and reserved.tolist() == [4500, 4500, 4000]
    # a 400,000-row prompt's 16,384-row chunk attends to (400,000 + 16,384) / 2 on average
    step = StepBatch.make([3000, 16_384], [1, 16_384], [0, 1])
    got = mid_prefill(step, 1, np.array([400_000]))
    assert got.context.tolist() == [3000, (400_000 + 16_384) // 2]
    assert got.query_rows.tolist() == [1, 16_384]


def test_phase_price_is_now_steps_then_arrival_steps_then_decode(dep):
    policy = LayoutPolicy(dep, PolicyConfig(price_phase=True))
    t = dep.world_size
    batch = StepBatch.make([3000] * 64, 1, np.arange(64) % t)  # 64 decoding, none prefilling
    hold = batch.context
    # one slot free now (max_seqs 65), then eight 2,048-row prompts as requests finish; each owner
    # may prefill (64 + 16,384) // 8 = 2,056 rows a step, so no chunk here is cut
    waiting = Waiting.make([2048] * 9, [4096] * 9, 64 + 16_384, 65)
    phase = PhasePrefill(now_rows=2048, now_requests=1, later_rows=8 * 2048, later_requests=8)
    horizon = 40.0
    priced = policy.pricer.admitted_costs(batch, hold, waiting)
    got = policy.pricer.phase_seconds_per_token(priced, batch, horizon, phase, hold, waiting)
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
        work = 9 * 2048 + horizon * 64
        assert got[layout] == pytest.approx(seconds / work, rel=1e-12), layout


def test_a_run_behind_the_first_goes_to_a_layout_that_can_take_the_batch_back(dep):
    policy = LayoutPolicy(dep, PolicyConfig(price_phase=True))
    t = dep.world_size
    batch = StepBatch.make([3000] * 64, 1, np.arange(64) % t)
    hold = batch.context
    # no slot free; four short prompts then a long one enter as requests finish
    waiting = Waiting.make([2048] * 4 + [300_000], [4096] * 4 + [301_000], 64 + 16_384, 64)
    phase = PhasePrefill(now_rows=0, now_requests=0, later_rows=4 * 2048 + 300_000, later_requests=5)
    horizon = 200.0
    priced = policy.pricer.admitted_costs(batch, hold, waiting)
    got = policy.pricer.phase_seconds_per_token(priced, batch, horizon, phase, hold, waiting)
    decode = StepBatch.make(batch.context, 1, batch.owners)
    ones = np.ones(64, dtype=np.int64)

    def price(layout, s):
        return step_time(layout, s, dep.model, dep.profile, dep.sizes).seconds

    def long_run(layout):  # (steps, seconds): the 300,000-row prompt on owner 0, at the mid-prefill context
        chunk = 2056 if layout in (Layout.DP, Layout.DOP) else 16_384  # an owner's share, or the budget
        step = StepBatch.make(np.append(batch.context, (300_000 + chunk) // 2), np.append(ones, chunk),
                              np.append(batch.owners, 0))
        n = -(-300_000 // chunk)
        return n, n * price(layout, step)

    # when the long one reaches the head the batch holds 64 x 3,000 + 4 x 4,096 (the short ones)
    # - 4 x 3,000 (the four requests they replaced) = 196,384 tokens: every pool holds that, so
    # every layout, DOP too, leaves the long prompt to the one that runs it fastest
    assert min(dep.pools[l] * (1 if l is Layout.TP else t) for l in Layout) > 196_384
    fastest = min((long_run(m) for m in Layout), key=lambda p: p[1])
    assert fastest[0] == 19  # the group's budget (CP or TP): 300,000 rows in 19 steps, not DOP's 146
    for layout, (cost, _, _) in priced.items():
        # the short prompts arrive one a step, four steps, in this layout
        arrive = StepBatch.make(np.append(batch.context, 2048), np.append(ones, 2048), np.append(batch.owners, 0))
        n_long, s_long = fastest
        seconds = 4 * price(layout, arrive) + s_long + (horizon - 4 - n_long) * price(layout, decode)
        want = seconds / (4 * 2048 + 300_000 + horizon * 64)
        assert got[layout] == pytest.approx(want, rel=1e-12), layout


def test_held_at_runs_counts_the_prompts_ahead_and_the_requests_they_replace():
    hold = np.array([100, 200, 300])  # mean 200
    runs = [Arrivals(np.array([10, 20]), np.array([50, 70]), 64, 30, False, True),
            Arrivals(np.array([9000]), np.array([9500]), 64, 9000, True, True),
            Arrivals(np.array([5]), np.array([40]), 64, 5, False, False)]
    got = held_at_runs(hold, np.array([30]), runs)
    # 600 held + 30 of the free slot; then + 120 - 2 x 200; then + 9,500 - 200
    assert got.tolist() == [630.0, 350.0, 9650.0]
    assert held_at_runs(hold, np.zeros(0, np.int64), []).size == 0


def test_a_layout_whose_pool_fills_past_the_others_prefills_the_run_itself(dep):
    policy = LayoutPolicy(dep, PolicyConfig(price_phase=True))
    t = dep.world_size
    batch = StepBatch.make([3000] * 64, 1, np.arange(64) % t)
    # the batch holds 7,040,000 tokens (CP's and DP-attention's pools hold 7,522,304 over the group,
    # DOP's 8,845,312, TP's 1,105,664: TP cannot hold it); four short prompts reserving 300,000 each
    # enter before a long one, so when it reaches the head the batch holds
    # 7,040,000 + 4 x 300,000 - 4 x 110,000 = 7,800,000: past CP's and DP-attention's pools
    hold = np.full(64, 110_000)
    waiting = Waiting.make([2048] * 4 + [300_000], [300_000] * 4 + [301_000], 64 + 16_384, 64)
    phase = PhasePrefill(now_rows=0, now_requests=0, later_rows=4 * 2048 + 300_000, later_requests=5)
    capacity = {l: dep.pools[l] * (1 if l is Layout.TP else t) for l in Layout}
    assert capacity[Layout.CP] == capacity[Layout.DP] < 7_800_000 < capacity[Layout.DOP]
    horizon = 200.0
    priced = policy.pricer.admitted_costs(batch, hold, waiting)
    assert not priced[Layout.TP][0].feasible
    got = policy.pricer.phase_seconds_per_token(priced, batch, horizon, phase, hold, waiting)
    decode = StepBatch.make(batch.context, 1, batch.owners)
    ones = np.ones(64, dtype=np.int64)

    def price(layout, s):
        return step_time(layout, s, dep.model, dep.profile, dep.sizes).seconds

    def long_run(layout):
        chunk = 2056 if layout in (Layout.DP, Layout.DOP) else 16_384
        step = StepBatch.make(np.append(batch.context, (300_000 + chunk) // 2), np.append(ones, chunk),
                              np.append(batch.owners, 0))
        n = -(-300_000 // chunk)
        return n, n * price(layout, step)

    for layout in (Layout.CP, Layout.DP, Layout.DOP):
        arrive = StepBatch.make(np.append(batch.context, 2048), np.append(ones, 2048), np.append(batch.owners, 0))
        if layout is Layout.DOP:
            n_long, s_long = long_run(Layout.DOP)  # only DOP's pool holds the batch DOP's admission fills
            assert n_long == 146
        else:  # CP's and DP-attention's batches stop at their pools (7,522,304): any of the three holds them
            n_long, s_long = min((long_run(m) for m in (Layout.CP, Layout.DP, Layout.DOP)), key=lambda p: p[1])
            assert n_long == 19
        seconds = 4 * price(layout, arrive) + s_long + (horizon - 4 - n_long) * price(layout, decode)
        want = seconds / (4 * 2048 + 300_000 + horizon * 64)
        assert got[layout] == pytest.approx(want, rel=1e-12), layout


def test_the_free_slots_prompts_split_into_one_run_per_kind():
    phase = PhasePrefill(now_rows=9000 + 3 * 500, now_requests=4)
    # budget 1,064 beside 64 decode rows: 1,000 prefill rows; the fifth prompt is not in a free slot
    runs = phase.now_runs(np.array([500, 500, 9000, 500, 7]), np.array([1, 2, 3, 4, 5]), 1064, 64)
    assert [(r.prompt.tolist(), r.reserved.tolist(), r.rows, r.long, r.more) for r in runs] == [
        ([500, 500, 500], [1, 2, 4], 1500, False, True), ([9000], [3], 9000, True, False)]
    # a long prompt at the head: its kind first; one kind alone is one run
    runs = PhasePrefill(now_rows=9500, now_requests=2).now_runs(np.array([9000, 500]), np.array([1, 2]), 1064, 64)
    assert [(r.prompt.tolist(), r.long) for r in runs] == [([9000], True), ([500], False)]
    runs = PhasePrefill(now_rows=1000, now_requests=2, later_rows=7, later_requests=1).now_runs(
        np.array([500, 500, 7]), np.array([1, 2, 3]), 1064, 64)
    assert [(r.prompt.tolist(), r.more) for r in runs] == [([500, 500], True)]
    assert all(r.token_budget == 1064 for r in runs)  # no finishing request needed: the full budget
    assert PhasePrefill(now_rows=5).now_runs(np.array([500]), np.array([1]), 1064, 64) == []


def test_a_long_prompt_behind_a_short_one_in_the_free_slots_runs_at_its_own_rate(dep):
    policy = LayoutPolicy(dep, PolicyConfig(price_phase=True))
    t = dep.world_size
    batch = StepBatch.make([3000] * 64, 1, np.arange(64) % t)
    hold = batch.context
    # two slots free: a 2,048-row prompt, then a 160,000-row one. Priced at the head's step both
    # would share it (2,048 + 14,336 rows; on owners 2,048 + 2,056); each runs at its own shape
    waiting = Waiting.make([2048, 160_000], [4096, 161_000], 64 + 16_384, 66)
    phase = PhasePrefill(now_rows=2048 + 160_000, now_requests=2)
    horizon = 200.0
    priced = policy.pricer.admitted_costs(batch, hold, waiting)
    got = policy.pricer.phase_seconds_per_token(priced, batch, horizon, phase, hold, waiting)
    decode = StepBatch.make(batch.context, 1, batch.owners)
    ones = np.ones(64, dtype=np.int64)
    for layout, (cost, _, _) in priced.items():
        if not cost.feasible:
            continue
        price = lambda s: step_time(layout, s, dep.model, dep.profile, dep.sizes).seconds  # noqa: E731
        short = StepBatch.make(np.append(batch.context, 2048), np.append(ones, 2048), np.append(batch.owners, 0))
        chunk, n_long = 16_384, 10  # the group's budget beside the 64 decode rows: ten steps
        if layout in (Layout.DP, Layout.DOP):
            chunk, n_long = 2056, 78  # one owner's share: 78 steps
        long = StepBatch.make(np.append(batch.context, (160_000 + chunk) // 2), np.append(ones, chunk),
                              np.append(batch.owners, 0))
        seconds = price(short) + n_long * price(long) + (horizon - 1 - n_long) * price(decode)
        want = seconds / (2048 + 160_000 + horizon * 64)
        assert got[layout] == pytest.approx(want, rel=1e-12), layout


def test_a_long_prompt_prefills_on_its_owner_at_the_owners_share(dep):
    policy = LayoutPolicy(dep, PolicyConfig(price_phase=True))
    t = dep.world_size
    batch = StepBatch.make([3000] * 64, 1, np.arange(64) % t)
    hold = batch.context
    # one slot free: a 160,000-row prompt enters now
    waiting = Waiting.make([160_000], [161_000], 64 + 16_384, 65)
    phase = PhasePrefill(now_rows=160_000, now_requests=1)
    horizon = 200.0
    priced = policy.pricer.admitted_costs(batch, hold, waiting)
    got = policy.pricer.phase_seconds_per_token(priced, batch, horizon, phase, hold, waiting)
    decode = StepBatch.make(batch.context, 1, batch.owners)
    for layout, (cost, _, _) in priced.items():
        if not cost.feasible:
            continue
        price = lambda s: step_time(layout, s, dep.model, dep.profile, dep.sizes).seconds  # noqa: E731
        chunk, n_pre = 16_384, 10  # the group's budget: 160,000 rows in ten steps
        if layout in (Layout.DP, Layout.DOP):
            chunk, n_pre = 2056, 78  # one owner's share: 160,000 rows in 78 steps
        now = StepBatch.make(np.append(batch.context, (160_000 + chunk) // 2), np.append(np.ones(64, np.int64), chunk),
                             np.append(batch.owners, 0))
        want = (n_pre * price(now) + (horizon - n_pre) * price(decode)) / (160_000 + horizon * 64)
        assert got[layout] == pytest.approx(want, rel=1e-12), layout


def test_an_int_still_means_every_row_starts_now(dep):
    policy = LayoutPolicy(dep, PolicyConfig(price_phase=True))
    batch = StepBatch.make([3000] * 63 + [8192], [1] * 63 + [8192], np.arange(64) % dep.world_size)
    priced = policy.pricer.admitted_costs(batch)
    as_int = policy.pricer.phase_seconds_per_token(priced, batch, 100.0, 8192 * 5)
    as_phase = policy.pricer.phase_seconds_per_token(priced, batch, 100.0, PhasePrefill(now_rows=8192 * 5))
    assert as_int == as_phase


def test_one_row_prompts_are_prefill_rows_not_an_infinite_phase(dep):
    # a queued request with one row left to prefill (a one-token prompt, or a sample whose prompt
    # pages it shares) looked like a decode row: its run had no prefill rows and every layout inf
    policy = LayoutPolicy(dep, PolicyConfig(price_phase=True))
    batch = StepBatch.make([64] * 6, 1, np.arange(6) % dep.world_size)
    waiting = Waiting.make([1, 1, 1], [65] * 3, 512, 256)
    phase = PhasePrefill(now_rows=3, now_requests=3)
    priced = policy.pricer.admitted_costs(batch, batch.context, waiting)
    got = policy.pricer.phase_seconds_per_token(priced, batch, 60.0, phase, batch.context, waiting)
    assert all(np.isfinite(v) for v in got.values()), got


def test_a_pool_that_holds_more_of_the_queue_decodes_the_same_rows_in_wider_steps():
    """Nothing running yet, a queue larger than any pool (a call's first decision under a tight
    budget): every layout is priced on the same decode rows -- a row a step for each request of
    the phase -- run in steps of the batch its own pool keeps, so the layout with the larger pool
    runs fewer steps."""
    import torch

    from splash_rollout.models.config import resolve_model
    from splash_rollout.rollout.config import EngineConfig
    from splash_rollout.rollout.build import make_policy

    policy = make_policy(EngineConfig(model="glm5-nano", world_size=2, layout="auto"), resolve_model("glm5-nano"),
                         2, 3 * 2**20, torch.float32)
    dep = policy.dep
    t, n = dep.world_size, 40
    batch = StepBatch.make(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
    waiting = Waiting.make([96] * n, [96 + 64] * n, 512, 256)
    phase = PhasePrefill(now_rows=96 * n, now_requests=n)
    horizon = 64.0
    priced = policy.pricer.admitted_costs(batch, batch.context, waiting)
    got = policy.pricer.phase_seconds_per_token(priced, batch, horizon, phase, batch.context, waiting)
    wide = {l: kept_decode(dep, l, batch, batch.context, waiting) for l in (Layout.DP, Layout.DOP)}
    assert 0 < wide[Layout.DP].size < wide[Layout.DOP].size < n  # both pools bind, DOP's holds more
    for layout, kept in wide.items():
        price = lambda s: step_time(layout, s, dep.model, dep.profile, dep.sizes).seconds  # noqa: E731
        # the now rows: the 40 prompts at the full-budget step of the queue's head, on owners
        cap = max(1, dep.chunk_tokens(layout, 512) // t)
        now, _, _ = admit(layout, batch, batch.context, waiting, 1 << 62, t, dep.page_size)
        now = prefill_step(now, 0, waiting.prompt, cap)
        n_now = -(-96 * n // now.rows)
        decode_s = (horizon - n_now) * price(kept) * n / kept.size  # n rows a step of work, kept.size a step
        want = (n_now * price(now) + decode_s) / (96 * n + horizon * n)
        assert got[layout] == pytest.approx(want, rel=1e-12), layout
