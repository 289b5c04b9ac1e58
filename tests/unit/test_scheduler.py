"""Scheduler: token budget, chunked prefill, admission by pages, continuous batching, page return."""
import pytest
import torch

from splash_rollout.engine.forward_batch import ForwardBatch, current_batch, forward_context
from splash_rollout.engine.placement import KVPlacement
from splash_rollout.layout import Layout
from splash_rollout.engine.request import Request, SamplingSpec
from splash_rollout.scheduling.admission import AdmissionSettings
from splash_rollout.engine.request_scheduler import Scheduler as _Scheduler

WORST_CASE = AdmissionSettings(mode="worst_case")


def Scheduler(placement, *args, **kw):
    """The rules these tests pin down: worst-case admission, no prompt sharing."""
    kw.setdefault("admission", WORST_CASE)
    kw.setdefault("prefix_sharing", False)
    return _Scheduler(placement, *args, **kw)


def _req(rid, prompt_len, max_new=4, max_len=1000, **kw):
    return Request(rid, list(range(2, 2 + prompt_len)), SamplingSpec(max_new_tokens=max_new, **kw), max_len, (1,))


def _drive(sched, token=7):
    """Run schedule/postprocess until done with a fake model; returns per-step schedules."""
    steps = []
    while sched.has_unfinished:
        s = sched.schedule()
        assert s, "stalled"
        assert sum(x.num_new for x in s) <= sched.max_num_batched_tokens
        steps.append([(x.request.request_id, x.start, x.num_new, x.samples) for x in s])
        r = sum(x.samples for x in s)
        sched.postprocess(s, [token] * r, [0.0] * r)
    return steps


def test_chunked_prefill_and_only_last_chunk_samples():
    pm = KVPlacement([64], 4, Layout.TP)
    sched = Scheduler(pm, max_num_batched_tokens=5)
    r = _req(0, 12, max_new=3)
    sched.add(r)
    steps = _drive(sched)
    assert steps[:3] == [[(0, 0, 5, False)], [(0, 5, 5, False)], [(0, 10, 2, True)]]
    assert steps[3:] == [[(0, 12, 1, True)], [(0, 13, 1, True)]]
    assert r.output_ids == [7, 7, 7] and r.finish_reason == "length"
    assert pm.managers[0].num_free == 64


def test_decode_rows_go_first_and_budget_mixes():
    pm = KVPlacement([64], 4, Layout.TP)
    sched = Scheduler(pm, max_num_batched_tokens=6)
    a, b = _req(0, 3, max_new=5), _req(1, 10, max_new=2)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert [(x.request.request_id, x.num_new) for x in first] == [(0, 3), (1, 3)]
    sched.postprocess(first, [9], [0.0])
    second = sched.schedule()
    assert [(x.request.request_id, x.num_new, x.samples) for x in second] == [(0, 1, True), (1, 5, False)]


def test_admission_waits_for_pages_and_pages_return():
    pm = KVPlacement([6], 4, Layout.TP)  # 24 tokens
    sched = Scheduler(pm, max_num_batched_tokens=100)
    reqs = [_req(i, 8, max_new=4) for i in range(3)]  # 12 tokens = 3 pages each
    for r in reqs:
        sched.add(r)
    first = sched.schedule()
    assert [x.request.request_id for x in first] == [0, 1] and len(sched.waiting) == 1
    assert sched.pages_promised()[0] + pm.managers[0].num_used == 6
    sched.postprocess(first, [7, 7], [0.0, 0.0])
    _drive(sched)
    assert all(r.finish_reason == "length" and len(r.output_ids) == 4 for r in reqs)
    assert pm.managers[0].num_free == 6


def test_page_table_grows_during_decode():
    pm = KVPlacement([16], 4, Layout.TP)
    sched = Scheduler(pm, max_num_batched_tokens=64)
    r = _req(0, 3, max_new=10)
    sched.add(r)
    sizes = []
    while sched.has_unfinished:
        s = sched.schedule()
        sizes.append(len(r.pages))
        sched.postprocess(s, [7], [0.0])
    assert sizes[0] == 1 and sizes[-1] == 3 and sizes == sorted(sizes)


def test_stop_conditions():
    pm = KVPlacement([32], 4, Layout.TP)
    sched = Scheduler(pm, 64)
    eos = _req(0, 2, max_new=10)
    ign = _req(1, 2, max_new=3, ignore_eos=True)
    stop = _req(2, 2, max_new=10, stop_token_ids=(1, 5))
    ctx = _req(3, 5, max_new=100, max_len=8, ignore_eos=True)
    for r in (eos, ign, stop, ctx):
        sched.add(r)
    _drive(sched, token=1)
    assert (eos.finish_reason, len(eos.output_ids)) == ("stop", 1)
    assert (ign.finish_reason, len(ign.output_ids)) == ("length", 3)
    assert (stop.finish_reason, len(stop.output_ids)) == ("stop", 1)
    assert (ctx.finish_reason, ctx.num_tokens) == ("length", 8)
    assert pm.managers[0].num_free == 32


def test_too_big_for_pool_and_abort():
    pm = KVPlacement([2], 4, Layout.TP)
    sched = Scheduler(pm, 16)
    with pytest.raises(ValueError, match="num_pages"):
        sched.add(_req(0, 8, max_new=4))
    r = _req(1, 3, max_new=4)
    sched.add(r)
    sched.schedule()
    assert sched.abort_all() == [r] and r.finish_reason == "abort"
    assert pm.managers[0].num_free == 2


def test_forward_batch_build_and_context_refuses_nesting():
    b = ForwardBatch.build([([5, 6, 7, 8, 9], 3, 2, [3, 0], True), ([1, 2, 3], 0, 3, [1], False)], page_size=4)
    assert b.input_ids.tolist() == [8, 9, 1, 2, 3]
    assert b.positions.tolist() == [3, 4, 0, 1, 2]
    assert b.out_slots.tolist() == [15, 0, 4, 5, 6]
    assert b.sample_rows.tolist() == [1]
    assert [s.start_pos for s in b.seqs] == [3, 0]
    with forward_context(b):
        assert current_batch() is b
        with pytest.raises(RuntimeError, match="already active"):
            with forward_context(b):
                pass
    with pytest.raises(RuntimeError):
        current_batch()


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=8),
       st.integers(1, 30), st.integers(1, 5), st.integers(8, 40))
def test_random_workloads_drain_within_budget(reqs, budget, page_size, num_pages):
    pm = KVPlacement([num_pages], page_size, Layout.TP)
    sched = Scheduler(pm, budget)
    admitted = []
    for i, (plen, new) in enumerate(reqs):
        r = _req(i, plen, max_new=new, ignore_eos=True)
        if sched.can_ever_admit(r):
            sched.add(r)
            admitted.append(r)
    computed = {r.request_id: 0 for r in admitted}
    while sched.has_unfinished:
        s = sched.schedule()
        assert s and sum(x.num_new for x in s) <= budget
        assert len({x.request.request_id for x in s}) == len(s)
        for x in s:
            assert x.start == computed[x.request.request_id]  # contiguous progress, no token twice
            assert len(x.request.pages) * page_size >= x.start + x.num_new
            computed[x.request.request_id] += x.num_new
        assert pm.managers[0].num_used + sched.pages_promised()[0] <= num_pages
        r = sum(x.samples for x in s)
        sched.postprocess(s, [7] * r, [0.0] * r)
    assert all(len(r.output_ids) == r.spec.max_new_tokens for r in admitted)
    assert pm.managers[0].num_free == num_pages


def test_kv_routes_make_every_rank_join_when_any_rank_moves_tokens():
    """A page relocated below a shrinking capacity on rank 0 alone is a move: rank 1, with nothing
    to send or receive, must still join the all-to-all (a collective only rank 0 entered hung)."""
    from splash_rollout.engine.kv_switch import KVMove
    from splash_rollout.engine.placement import NOT_HERE
    from splash_rollout.engine.switcher import token_routes

    move = KVMove(request_id=0, owner=0, num_tokens=20, src_pages=[[0, 40], [NOT_HERE, NOT_HERE]],
                  dst_pages=[[0, 3], [NOT_HERE, NOT_HERE]])
    r0, r1 = (token_routes([move], rank, 2, 16) for rank in (0, 1))
    assert r0.network and not r1.network  # only rank 0 copies its page 40 -> 3
    assert r0.collective and r1.collective
    assert r0.send_slots[0] == [40 * 16 + x for x in range(4)] and r0.recv_slots[0] == [3 * 16 + x for x in range(4)]
    still = KVMove(0, 0, 20, [[0, 1], [NOT_HERE, NOT_HERE]], [[0, 1], [NOT_HERE, NOT_HERE]])
    assert not token_routes([still], 1, 2, 16).collective  # nothing moves anywhere: no collective


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 24), st.integers(4, 40)), min_size=2, max_size=10),
       st.sampled_from(list(Layout)), st.integers(1, 48), st.integers(1, 4), st.integers(8, 30))
def test_the_quick_bound_on_a_steps_pages_never_hides_pressure(reqs, layout, budget, page_size, num_pages):
    """``_surely_fits`` (ceil(budget / page) + 2 x running free pages on every rank) skips the exact
    per-request count; wherever it says so, the exact count finds the step's pages free -- over
    random workloads with shared prompts (followers copying a last page), every layout, two ranks,
    pools small enough that optimistic admission runs out of pages and retracts."""
    pm = KVPlacement([num_pages] * 2, page_size, layout)
    sched = _Scheduler(pm, budget, prefix_sharing=True)
    for i, (prompt, plen, new) in enumerate(reqs):
        r = Request(i, [3 + prompt] * plen, SamplingSpec(max_new_tokens=new, ignore_eos=True), 1000, (1,))
        if sched.can_ever_admit(r):
            sched.add(r)
    while sched.has_unfinished:
        if sched._surely_fits():
            need = sched._step_need(sched._running_rows())
            assert all(n <= f for n, f in zip(need, pm.pages_free)), (need, pm.pages_free)
        s = sched.schedule()
        assert s
        r = sum(x.samples * (1 + len(x.forks)) for x in s)  # a leader's last prompt row samples for its followers too
        sched.postprocess(s, [7] * r, [0.0] * r)
    assert pm.pages_free == [num_pages] * 2
