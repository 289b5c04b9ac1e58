"""Speculative decoding changes how many steps a rollout takes, never what it writes: with
``speculation="always"`` every sample's tokens (and, under reproducible numerics, logprobs) equal
``"off"``'s -- greedy and seeded sampling, groups that share their prompt's KV, stop tokens, the
context limit, a pool small enough to retract, multi-turn continuation -- and no page is held after
a call. The drafter here is the n-gram one (``draft="ngram"``), which proposes what followed the longest match among
the prompt's samples; the MTP module's drafts are in tests/unit/test_mtp_drafter.py. The
multi-rank layouts and live switches are in tests/distributed/test_speculation_ranks.py."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams
from splash_rollout.engine.drafter import SuffixDrafter
from splash_rollout.engine.request import Request, SamplingSpec
from splash_rollout.scheduling.cost_model import StepBatch
from tests.unit.test_nothing_lost import assert_nothing_held

MAX_LEN = 56
STOP = 106


def _engine(speculation: str) -> RolloutEngine:
    # 40 pages of 4 tokens: a few requests at their cap fill it, so optimistic admission retracts
    return RolloutEngine(EngineConfig(model="glm5-nano", speculation=speculation, draft="ngram", numerics="reproducible",
                                      num_pages=40, page_size=4, max_model_len=MAX_LEN, max_num_batched_tokens=64,
                                      max_num_seqs=12))


@pytest.fixture(scope="module")
def engines():
    with _engine("off") as off, _engine("always") as always:
        yield off, always


def _same(a, b) -> None:
    assert [s.response_ids for s in a.samples] == [s.response_ids for s in b.samples]
    assert [s.response_logprobs for s in a.samples] == [s.response_logprobs for s in b.samples]
    assert [s.finish_reason for s in a.samples] == [s.finish_reason for s in b.samples]


sampling = st.sampled_from([dict(temperature=0.0), dict(temperature=1.0, top_k=4), dict(temperature=0.8, top_p=0.9),
                            dict(temperature=1.0, min_p=0.1)])


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(prompts=st.lists(st.lists(st.integers(3, 9), min_size=2, max_size=24), min_size=1, max_size=3),
       n=st.sampled_from([1, 4, 8]), kind=sampling, new=st.integers(1, 48), stop=st.sets(st.integers(3, 9), max_size=1),
       seed=st.integers(0, 2**31))
def test_always_writes_what_off_writes(engines, prompts, n, kind, new, stop, seed):
    off, always = engines
    params = SamplingParams(n=n, max_new_tokens=new, stop_token_ids=tuple(stop), ignore_eos=True, seed=seed, **kind)
    a, b = off.generate(prompts, params), always.generate(prompts, params)
    _same(a, b)
    assert_nothing_held(off)
    assert_nothing_held(always)


def test_drafts_are_verified_and_cut_steps_on_a_repetitive_group(engines):
    off, always = engines
    prompts = [[5, 6, 7, 8] * 4]
    params = SamplingParams(n=4, temperature=0.0, max_new_tokens=40, ignore_eos=True)
    a, b = off.generate(prompts, params), always.generate(prompts, params)
    _same(a, b)
    assert b.metrics["spec/accepted_tokens"] > 0 and b.metrics["spec/acceptance_len"] > 1.0
    assert b.metrics["perf/steps"] < a.metrics["perf/steps"]
    assert a.metrics["spec/draft_tokens"] == 0 and a.metrics["spec/steps_on"] == 0


@pytest.mark.parametrize("draft", ["ngram", "mtp"])
def test_routing_of_the_kept_tokens_is_what_off_records(draft):
    """Verified rows route drafted tokens; a rejected one's position is run again with the kept token
    and the rows past a request's end are cut: every sample's routing equals speculation='off''s. The
    MTP module's own router (it drafts with a mirrored module, whose drafts are kept) is no layer of it."""
    from splash_rollout.models.config import resolve_model
    from splash_rollout.models.model import MLAForCausalLM
    from tests.unit.test_mtp_drafter import mirror_mtp

    prompts = [[5, 6, 7, 8] * 4, [3, 9] * 5]
    # a stop token inside a verified draft ends the request with drafted rows run past its end
    params = SamplingParams(n=4, temperature=1.0, top_k=3, max_new_tokens=30, stop_token_ids=(STOP,), seed=3)
    batches = []
    for speculation in ("off", "always"):
        with RolloutEngine(EngineConfig(model="glm5-nano", speculation=speculation, draft=draft,
                                        numerics="reproducible", return_routing=True, max_model_len=MAX_LEN)) as engine:
            if speculation == "always" and draft == "mtp":
                engine.update_weights(mirror_mtp(MLAForCausalLM.from_config(resolve_model("glm5-nano"), seed=0)),
                                      version=1)
            batches.append(engine.generate(prompts, params))
    off, on = batches
    _same(off, on)
    assert any(s.finish_reason == "stop" for s in on.samples)
    assert on.metrics["spec/accepted_tokens"] > 0 and on.metrics["spec/accepted_tokens"] < on.metrics["spec/draft_tokens"]
    for a, b in zip(off.samples, on.samples):
        assert a.routing.shape == b.routing.shape == (len(a.prompt_ids) + len(a.response_ids) - 1,) + a.routing.shape[1:]
        assert np.array_equal(a.routing, b.routing)


def test_multi_turn_continuation_is_the_same(engines):
    off, always = engines
    prompts = [[3, 4, 5] * 5, [7, 7, 8] * 4]
    params = SamplingParams(n=2, temperature=1.0, top_k=3, max_new_tokens=10, ignore_eos=True, seed=11)
    a, b = off.generate(prompts, params), always.generate(prompts, params)
    _same(a, b)
    replies = [[9, 9]] * len(a.samples)
    more = SamplingParams(n=1, temperature=1.0, top_k=3, max_new_tokens=12, ignore_eos=True, seed=12)
    _same(off.continue_samples(a.samples, replies, more), always.continue_samples(b.samples, replies, more))
    assert_nothing_held(always)


def _request(rid: int, prompt: list[int], output: list[int]) -> Request:
    return Request(rid, list(prompt), SamplingSpec(max_new_tokens=64), 1024, output_ids=list(output),
                   output_logprobs=[0.0] * len(output))


def test_the_drafter_proposes_what_followed_the_longest_match():
    drafter = SuffixDrafter(max_draft=4, max_ngram=3, tokens_per_match=2.0, min_confidence=0.0)
    prompt = [1, 2, 3]
    sibling = _request(0, prompt, [10, 11, 12, 13, 14, 15])
    drafter.observe(sibling, 0, 0)
    me = _request(1, prompt, [20, 11, 12])
    # the longest suffix seen before is (11, 12) in the sibling: 2 tokens matched -> up to 4 drafted
    assert drafter.propose(me, 8) == (13, 14, 15)
    assert drafter.propose(me, 2) == (13, 14)
    # the prompt's earlier responses stay after they finish
    drafter.finished(sibling)
    later = _request(2, prompt, [12, 13])
    assert drafter.propose(later, 8) == (14, 15)
    # another prompt's text is never proposed
    assert drafter.propose(_request(3, [4, 5], [11, 12]), 8) == ()


def test_drafts_run_as_long_as_the_samples_agree():
    drafter = SuffixDrafter(max_draft=8, max_ngram=2, tokens_per_match=4.0, min_confidence=0.3)
    prompt = [1]
    drafter.observe(_request(0, prompt, [10, 11, 12, 13, 14]), 0, 0)
    me = _request(9, prompt, [10])
    # one sighting of each continuation: 1/2 each, and 1/2 x 1/2 < 0.3 -- one token
    assert drafter.propose(me, 8) == (11,)
    for rid in (1, 2, 3):  # three more samples wrote the same: 4/5 per token, 0.8^5 = 0.33 >= 0.3
        drafter.observe(_request(rid, prompt, [10, 11, 12, 13, 14, 15]), 0, 0)
    assert drafter.propose(me, 8) == (11, 12, 13, 14, 15)
    # where they diverge the draft stops before the fork
    drafter.observe(_request(4, prompt, [10, 11, 99]), 0, 0)
    assert drafter.propose(me, 8)[:1] == (11,)


def test_a_single_token_match_drafts_nothing_unless_allowed():
    sibling = _request(0, [1], [10, 11, 12, 13])
    me = _request(1, [1], [20, 12])  # only the token 12 was seen before
    for min_match, expected in ((2, ()), (1, (13,))):
        drafter = SuffixDrafter(max_ngram=3, min_match=min_match, min_confidence=0.0)
        drafter.observe(sibling, 0, 0)
        assert drafter.propose(me, 8) == expected
    with pytest.raises(ValueError, match="min_match"):
        SuffixDrafter(max_ngram=2, min_match=3)


def test_each_draft_is_credited_to_where_its_first_token_was_seen():
    from splash_rollout.engine.step_log import StepRecord
    from splash_rollout.rollout.call_timeline import speculation_metrics

    drafter = SuffixDrafter(max_ngram=3, min_confidence=0.0)
    drafter.new_call()
    prompt = [1, 2, 3, 1, 2]
    first = _request(1, prompt, [])
    assert drafter.propose(first, 1) == (3,) and drafter.source(first) == "prompt"  # (1, 2) -> 3 in the prompt
    drafter.observe(_request(0, prompt, [7, 8, 9]), 0, 0)
    sibling = _request(2, prompt, [7, 8])
    assert drafter.propose(sibling, 1) == (9,) and drafter.source(sibling) == "group"
    drafter.observe(sibling, 1, 1)
    mine = _request(3, prompt, [5, 6, 4, 5, 6])
    assert drafter.propose(mine, 1) == (4,) and drafter.source(mine) == "own"
    drafter.new_call()  # the next call: the first call's samples are history
    later = _request(4, prompt, [7, 8])
    assert drafter.propose(later, 1) == (9,) and drafter.source(later) == "history"
    drafter.observe(later, 1, 0)
    assert drafter.stats.by_source["group"] == [1, 1, 1] and drafter.stats.by_source["history"] == [1, 1, 0]
    steps = [StepRecord(0, "tp", draft_tokens=2, verified=2, accepted_tokens=1,
                        draft_sources={"group": [1, 1, 1], "history": [1, 1, 0]})]
    metrics = speculation_metrics(steps)
    assert metrics["spec/acceptance_len/group"] == 2.0 and metrics["spec/acceptance_len/history"] == 1.0
    assert metrics["spec/verified/own"] == 0.0 and metrics["spec/acceptance_len"] == 1.5


def test_a_verified_step_is_priced_by_the_rows_it_ran():
    """The layout policy and the gate read a step after its postprocess: a verification that rejected
    its drafts has computed fewer positions than its rows saw (a 6-token request drafting 8 and
    keeping none: 9 rows over 14 positions, 7 computed after)."""
    from splash_rollout.engine.layout_driver import _executed_batch
    from splash_rollout.engine.request_scheduler import ScheduledSeq

    req = _request(0, [1, 2, 3, 4, 5], [6])
    req.num_computed_tokens = 5
    seq = ScheduledSeq(req, 9, draft=(7,) * 8)
    req.num_computed_tokens, req.output_ids = 6, [6, 9]  # kept: the last token's row, then a new token
    step = _executed_batch([seq])
    assert step.context.tolist() == [14] and step.query_rows.tolist() == [9]


def test_a_rejected_draft_shortens_the_next():
    drafter = SuffixDrafter(max_draft=8, max_ngram=2, tokens_per_match=4.0, min_confidence=0.0)
    prompt = [1]
    drafter.observe(_request(0, prompt, list(range(10, 30))), 0, 0)
    me = _request(1, prompt, [10, 11])
    assert len(drafter.propose(me, 16)) == 8
    drafter.observe(me, 8, 0)  # none accepted: at most 2 * 0 + 1 next time
    assert len(drafter.propose(me, 16)) == 1
    drafter.observe(me, 1, 1)  # all accepted: doubles
    assert len(drafter.propose(me, 16)) == 2
    assert (drafter.stats.proposed, drafter.stats.accepted) == (9, 1)


def test_the_history_of_a_prompt_is_bounded():
    drafter = SuffixDrafter(max_ngram=1, min_match=1, history_per_prompt=2, min_confidence=0.0)
    for rid in range(4):
        r = _request(rid, [1], [100 + rid, 200 + rid])
        drafter.observe(r, 0, 0)
        drafter.finished(r)
    index = drafter._prompts[(1,)]
    assert sorted(index.sequences) == [2, 3] and index.history == [2, 3]
    assert drafter.propose(_request(9, [1], [100]), 4) == ()  # dropped with its sequence
    assert drafter.propose(_request(10, [1], [103]), 4) == (203,)


def test_dropped_sequences_are_counted_out_and_the_index_is_bounded_in_tokens():
    drafter = SuffixDrafter(max_ngram=3, history_per_prompt=2, min_confidence=0.0)
    responses = [[7, 8, 9, 7, 8], [7, 8, 10], [9, 9, 7, 8, 9], [8, 7, 8, 10, 11]]
    for rid, response in enumerate(responses):
        r = _request(rid, [1, 2], response)
        drafter.observe(r, 0, 0)
        drafter.finished(r)
    fresh = SuffixDrafter(max_ngram=3, history_per_prompt=2, min_confidence=0.0)
    for rid in (2, 3):  # the two kept: the index is as if the dropped ones had never been seen
        fresh.observe(_request(rid, [1, 2], responses[rid]), 0, 0)
    for d in (drafter, fresh):  # a draft asked of the prompt indexes what it holds
        assert d.propose(_request(9, [1, 2], [7, 8]), 2)
    assert drafter._prompts[(1, 2)].followers == fresh._prompts[(1, 2)].followers
    assert drafter._tokens == fresh._tokens == 2 + 5 + 5 + 2  # the prompt, the two kept and the asking one
    bounded = SuffixDrafter(max_ngram=3, max_tokens=14, min_confidence=0.0)
    for p in range(4):  # each prompt holds 2 + 5 tokens: a third prompt drops the least recently drafted
        bounded.observe(_request(p, [1, 2 + p], [7, 8, 9, 7, 8]), 0, 0)
        assert bounded._tokens <= 14
    assert list(bounded._prompts) == [(1, 4), (1, 5)]


def test_a_call_that_never_drafts_indexes_nothing():
    drafter = SuffixDrafter(max_ngram=3, min_confidence=0.0)
    for rid in range(4):
        drafter.observe(_request(rid, [1, 2], [7, 8, 9, 7, 8]), 0, 0)
    index = drafter._prompts[(1, 2)]
    assert not index.followers and len(index.pending) == 5  # the prompt and four samples, held
    assert drafter.propose(_request(9, [1, 2], [7, 8]), 3) == (9, 7, 8)
    assert index.followers and not index.pending


def test_under_retraction_pressure_the_tokens_are_the_same(engines):
    off, always = engines
    prompts = [[4, 5, 6, 4, 5, 6], [7, 8, 7, 8, 7], [3, 9, 3, 9]]
    params = SamplingParams(n=8, temperature=1.0, top_k=3, max_new_tokens=40, ignore_eos=True, seed=7)
    a, b = off.generate(prompts, params), always.generate(prompts, params)
    _same(a, b)
    assert a.metrics["rollout/retractions"] > 0 and b.metrics["rollout/retractions"] > 0
    assert b.metrics["spec/accepted_tokens"] > 0
    assert_nothing_held(always)


def test_the_gate_drafts_where_rows_are_cheap_and_not_where_the_batch_is_wide():
    from splash_rollout.engine.drafter import DraftStats
    from splash_rollout.engine.speculation_gate import SpeculationGate

    def price(step):  # a fixed 10 ms a step, then 1 ms a row beyond 16 rows (rows are free until then)
        return 0.010 + 0.001 * max(0, int(step.query_rows.sum()) - 16)

    stats = DraftStats(proposed=100, accepted=60, rejections=20, asked=50, drafted_requests=40)
    gate = SpeculationGate(price, stats, max_draft=8, min_observed=0, regime_steps=0)  # θ alone
    overall = (60 + 8) / (80 + 16)
    assert gate.alpha() == pytest.approx((60 + overall * 16) / (80 + 16))  # no new_call yet: all of it is this call's
    gate_b = SpeculationGate(price, stats, max_draft=8)
    gate_b.new_call()
    assert gate_b.alpha() == pytest.approx(overall)  # a new call starts at every call's
    tail = gate.choose(0, np.full(2, 100))
    assert tail.cap > 0 and tail.tokens_per_s[tail.cap] > tail.tokens_per_s[0]
    wide = gate.choose(1, np.full(256, 100))
    assert wide.cap == 0
    assert [e["cap"] for e in gate.log] == [tail.cap, 0] and "256 decoding" in gate.log[-1]["reason"]
    # drafted steps that measured four times their price next to plain ones at theirs: the tail's
    # drafts no longer pay
    for _ in range(30):
        gate.observe(StepBatch.make(np.full(2, 100), np.full(2, 5), np.zeros(2, np.int64)), 0.040, drafted=True)
        gate.observe(StepBatch.make(np.full(2, 100), np.ones(2, np.int64), np.zeros(2, np.int64)), 0.010,
                     drafted=False)
    assert gate.draft_overhead(2) == pytest.approx(4.0, rel=0.01)
    assert gate.draft_overhead(256) == 1.0  # measured at 2 requests: says nothing of 256
    assert gate.choose(100, np.full(2, 100)).cap == 0


def test_auto_writes_what_off_writes(engines):
    off, _ = engines
    prompts = [[5, 6, 7, 8] * 4, [3, 4] * 5]
    params = SamplingParams(n=4, temperature=1.0, top_k=3, max_new_tokens=30, ignore_eos=True, seed=5)
    with _engine("auto") as auto:
        b = auto.generate(prompts, params)
        assert b.timeline.speculation and b.timeline.speculation[0]["step"] == 0
        _same(off.generate(prompts, params), b)
        assert_nothing_held(auto)


def test_the_gate_measures_the_kind_of_step_it_did_not_choose():
    from splash_rollout.engine.drafter import DraftStats
    from splash_rollout.engine.speculation_gate import SpeculationGate

    gate = SpeculationGate(lambda step: 0.010, DraftStats(), max_draft=4, min_observed=2, explore_every=4)
    lockstep = dict(queued=0, tokens_left=np.full(2, 100))
    caps = [gate.choose(step, np.full(2, 50), **lockstep).cap for step in range(9)]
    assert caps[0] == 0 and caps[4] == 0 and caps[8] == 0 and all(c > 0 for i, c in enumerate(caps) if i % 4)
    plain = StepBatch.make(np.full(2, 50), np.ones(2, np.int64), np.zeros(2, np.int64))
    gate.observe(plain, 0.010, drafted=False)
    gate.observe(plain, 0.010, drafted=False)
    assert all(gate.choose(step, np.full(2, 50), **lockstep).cap > 0 for step in range(12, 24))


def test_the_gate_does_not_explore_drafts_the_drafter_has_none_for():
    """A wide batch whose requests got no draft when asked: exploring it again would ask all of them
    every few steps for nothing (and, under DP-attention, end every token window there)."""
    from splash_rollout.engine.drafter import DraftStats
    from splash_rollout.engine.speculation_gate import SpeculationGate

    stats = DraftStats()
    gate = SpeculationGate(lambda step: 0.010, stats, max_draft=4, min_observed=2, explore_every=4,
                           prior_alpha=0.1)  # θ keeps drafts off at 256 requests
    lockstep = dict(queued=0, tokens_left=np.full(256, 100))
    wide = np.full(256, 50)
    caps = [gate.choose(step, wide, **lockstep).cap for step in range(4)]
    assert caps == [2, 0, 0, 0]  # the first exploration: nothing measured yet, half the requests expected to draft
    stats.asked += 256  # ... but none of them got a draft
    assert all(gate.choose(step, wide, **lockstep).cap == 0 for step in range(4, 40))
    stats.asked += 64
    stats.drafted_requests += 48  # a later call whose samples do draft: exploring pays again
    gate.new_call()
    stats.asked += 16
    stats.drafted_requests += 12
    assert any(gate.choose(step, wide, **lockstep).cap > 0 for step in range(40, 48))


def test_while_requests_wait_the_gate_keeps_the_kind_of_step_that_measured_faster():
    from splash_rollout.engine.drafter import DraftStats
    from splash_rollout.engine.speculation_gate import SpeculationGate

    # θ: a step costs the same whatever its rows, so drafts look free and auto drafts at first
    gate = SpeculationGate(lambda step: 0.010, DraftStats(asked=10, drafted_requests=9), max_draft=4,
                           regime_steps=4, min_observed=0)
    wide = np.full(64, 50)
    kinds = []
    for step in range(12):
        cap = gate.choose(step, wide, queued=100).cap
        kinds.append(cap > 0)
        # measured: drafted steps write 80 tokens in 20 ms, plain ones 64 in 10 ms
        gate.measure(80 if cap else 64, 0.020 if cap else 0.010, drafted=cap > 0)
    # a run of the kind θ would not choose, then θ's drafts measured as they run, then the faster kind
    assert kinds == [False] * 4 + [True] * 4 + [False] * 4
    # each run's first quarter (here its first step: the previous kind's aftermath) is not counted
    assert gate.throughput[(gate.width(64), True)][0] == pytest.approx(1 + 0.97 + 0.97 ** 2)
    choice = gate.choose(12, wide, queued=100)
    assert choice.cap == 0 and "measured 6400 tok/s plain vs 4000 drafted" in choice.reason
    assert any("measuring a run of plain steps" in e["reason"] for e in gate.log)
    # the lockstep objective (nothing waits) is not decided by what was measured while requests waited
    assert gate.choose(13, np.full(2, 50), queued=0, tokens_left=np.full(2, 100)).cap > 0


def test_the_timeline_marks_where_drafts_were_verified(engines, tmp_path):
    from splash_rollout.reporting.timeline_report import plot_timeline

    off, always = engines
    params = SamplingParams(n=4, temperature=0.0, max_new_tokens=24, ignore_eos=True)
    on = always.generate([[5, 6, 7, 8] * 4], params).timeline.to_dict()
    spans = [s for p in on["phases"] for s in p["speculation_spans"]]
    assert spans and all(p["t_start"] <= a < b <= p["t_end"] + 1e-9 for p in on["phases"]
                         for a, b in p["speculation_spans"])
    plain = off.generate([[5, 6, 7, 8] * 4], params).timeline.to_dict()
    assert not any(p["speculation_spans"] for p in plain["phases"])
    assert (tmp_path / "t.png").exists() is False and plot_timeline(str(tmp_path / "t.png"), [(0, on), (1, plain)])
    assert (tmp_path / "t.png").stat().st_size > 0


def test_with_nothing_queued_the_gate_prices_the_slowest_request():
    from splash_rollout.engine.drafter import DraftStats
    from splash_rollout.engine.speculation_gate import SpeculationGate

    def price(step):  # a fixed 10 ms a step, 0.2 % more per row
        return 0.010 * (1 + 0.002 * int(step.query_rows.sum()))

    gate = SpeculationGate(price, DraftStats(asked=100, drafted_requests=90), max_draft=2, min_observed=0,
                           regime_steps=0)
    for _ in range(40):  # under cap 2 a drafting request kept 0 or 2 tokens, half the time each
        gate.record(2, verified=10, drafted=20, accepted=10, accepted_sq=20)
    assert gate.per_request(2) == pytest.approx((2.0, 1.0)) and gate.spread(2) == pytest.approx(1.0)
    wide = np.full(64, 50)
    queued = gate.choose(0, wide, queued=10)  # the queue refills the batch: throughput decides
    assert queued.cap == 2
    last = gate.choose(1, wide, queued=0, tokens_left=np.full(64, 4))
    assert last.cap == 0 and "slowest request" in last.reason  # 64 in lockstep, 4 steps left: no gain
    tail = gate.choose(2, np.full(2, 50), queued=0, tokens_left=np.full(2, 200))
    assert tail.cap == 2  # two long requests: the slowest gains nearly the mean


def test_the_drivers_pressure_probe_leaves_the_replica_unchanged():
    """Rank 0's driver asks ``pressure()`` before a step and the other ranks never do, so asking it
    must change nothing the next ``schedule`` depends on -- here the drafter's index, whose n-gram
    counts break ties by the order tokens were indexed in. Two replicas take the same tokens under a
    tight pool and a draft cap that turns on and off; one is probed before every step."""
    import random

    import torch

    from splash_rollout.engine.placement import KVPlacement
    from splash_rollout.engine.request_scheduler import Scheduler
    from splash_rollout.layout import Layout

    def replica() -> Scheduler:
        sched = Scheduler(KVPlacement([32], 4, Layout.TP), max_num_batched_tokens=32, max_num_seqs=12,
                          drafter=SuffixDrafter(max_draft=4, min_match=1, min_confidence=0.0))
        for rid in range(12):
            sched.add(Request(rid, [3 + rid % 3, 4, 5], SamplingSpec(max_new_tokens=40, ignore_eos=True), 1024))
        return sched

    probed, plain = replica(), replica()
    rng, probes, step = random.Random(1), 0, 0
    while plain.has_unfinished:
        probes += bool(probed.pressure()[0] or not probed._surely_fits())
        cap = 4 if (step // 3) % 2 else 0
        probed.draft_cap = plain.draft_cap = cap
        a, b = probed.schedule(), plain.schedule()
        assert [(s.request.request_id, s.num_new, s.draft) for s in a] == \
               [(s.request.request_id, s.num_new, s.draft) for s in b], f"step {step}"
        rows = sum(len(s.draft) + 1 if s.draft else (1 + len(s.forks)) * s.samples for s in b)
        tokens = [rng.randrange(6, 16) for _ in range(rows)]
        probed.postprocess(a, tokens, [0.0] * rows)
        plain.postprocess(b, tokens, [0.0] * rows)
        step += 1
    assert probes > 0 and plain.drafter.stats.accepted > 0


def test_max_draft_tokens_bounds_every_verified_draft():
    """``compute.max_draft_tokens`` caps the drafter (and the gate) of either source; its tokens are
    still the ones ``off`` writes."""
    from splash_rollout.engine.rank_engine import Engine
    from splash_rollout.models.config import PRESETS
    from splash_rollout.models.model import MLAForCausalLM
    from splash_rollout.rollout.build import engine_settings

    cfg = PRESETS["glm5-nano"]
    outputs = {}
    for longest in (None, 2):
        config = EngineConfig(model=cfg, memory=dict(num_pages=64, page_size=4),
                              compute=dict(speculation="always", draft="ngram", max_draft_tokens=longest))
        engine = Engine.single(MLAForCausalLM.from_config(cfg, seed=0), cfg, engine_settings(config))
        reqs = [Request(i, [3, 4, 5, 6, 7, 3, 4, 5, 6, 7], SamplingSpec(temperature=0.0, max_new_tokens=24,
                                                                          ignore_eos=True), 64) for i in range(2)]
        outputs[longest] = {r.request_id: r.output_ids for r in engine.serve(reqs)}
        widest = max(len(s.draft_positions) for s in engine.step_log)
        assert engine.scheduler.drafter.max_draft == (longest or 8)
        assert widest > 2 if longest is None else widest == 2  # uncapped drafts run longer: the cap bounds them
    assert outputs[None] == outputs[2]
    with pytest.raises(ValueError, match="compute.max_draft_tokens: expected None or an integer >= 1"):
        EngineConfig(compute={"max_draft_tokens": 0})
