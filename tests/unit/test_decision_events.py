"""Decide at events: the driver consults the policy when something changed, and at least every K steps."""
from types import SimpleNamespace

import numpy as np
import pytest

from splash_rollout.engine.layout_driver import DriverConfig, LayoutDriver
from splash_rollout.engine.step_log import StepRecord
from splash_rollout.layout import Layout
from splash_rollout.scheduling import Decision, LayoutPolicy, PolicyConfig
from splash_rollout.scheduling.decision_events import DecisionEvents
from tests.pinned_profile import PINNED_PROFILE


def test_events_in_order_of_what_changed():
    ev = DecisionEvents(every_steps=10, batch_fraction=0.25)
    assert ev.due(0, 8, 4) == "call"
    ev.decided(0, 8, 4)
    assert ev.due(1, 8, 4) is None
    # against the 8 requests the last decision saw, a change is real at 2 (25 %), not at 1
    assert ev.due(1, 9, 3) is None and ev.due(1, 10, 2) == "admitted"  # the queue shrank by 2
    assert ev.due(1, 6, 4) == "batch moved" and ev.due(1, 7, 4) is None
    ev.finished(1)
    assert ev.due(1, 8, 4) is None
    ev.finished(1)
    assert ev.due(1, 8, 4) == "finished"  # two finished (and two admitted in their place)
    assert ev.due(1, 8, 4, deferred=True) == "deferred"
    ev.ask("measured")
    assert ev.due(1, 8, 4) == "measured" and ev.due(1, 8, 4, deferred=True) == "deferred"
    ev.decided(1, 8, 4)
    assert ev.due(10, 8, 4) is None and ev.due(11, 8, 4) == "every"
    ev.reset()
    assert ev.due(12, 8, 4) == "call"
    # a wide batch: 50 of 200 must finish before the answer can change; a batch of 2, one
    ev.decided(12, 200, 0)
    ev.finished(49)
    assert ev.due(13, 200, 0) is None
    ev.finished(1)
    assert ev.due(13, 200, 0) == "finished"
    ev.decided(13, 2, 0)
    ev.finished(1)
    assert ev.due(14, 1, 0) == "finished"
    ev.decided(14, 0, 5)  # an empty batch: one admission is a change
    assert ev.due(15, 1, 4) == "admitted"
    with pytest.raises(ValueError, match="every_steps"):
        DecisionEvents(every_steps=0)
    with pytest.raises(ValueError, match="batch_fraction"):
        DecisionEvents(batch_fraction=0.0)


def _req(i, ctx=64, out=4):
    return SimpleNamespace(request_id=i, num_uncomputed_tokens=1, in_prefill=False, num_computed_tokens=ctx,
                           num_tokens=ctx + 1, owner=i % 2, max_total_tokens=ctx + 64, num_output_tokens=out,
                           spec=SimpleNamespace(max_new_tokens=64), finish_reason=None, fork_of=None,
                           num_shared_pages=0)


def _scheduler(running, waiting=()):
    """What the driver reads of a scheduler: its queues, budgets, expected totals and pressure (none)."""
    return SimpleNamespace(running=list(running), waiting=list(waiting), max_num_batched_tokens=512,
                           max_num_seqs=256, placement=SimpleNamespace(page_size=1),
                           expected_total=lambda r: r.max_total_tokens, pressure=lambda: ([0, 0], []))


class CountingPolicy(LayoutPolicy):
    """A real policy over glm5-nano on two ranks that records which steps consulted it."""

    def __init__(self, config, want: Layout | None = None):
        import torch

        from splash_rollout.models.config import resolve_model
        from splash_rollout.rollout.config import EngineConfig
        from splash_rollout.rollout.build import make_policy

        config_on_two = EngineConfig(model="glm5-nano", world_size=2, layout="auto", profile=PINNED_PROFILE)
        base = make_policy(config_on_two, resolve_model("glm5-nano"), 2, 2**28, torch.float32)
        super().__init__(base.dep, config, base.correction)
        self.want, self.calls, self.observed = want, [], 0

    def decide(self, current, batch, *args, **kwargs):
        self.calls.append(batch.size)
        d = super().decide(current, batch, *args, **kwargs)
        if self.want is not None and current is not self.want:
            return Decision(current, self.want, current is not None, "test: move", d.step_costs)
        return d

    def observe_step(self, layout, batch, measured_s, signature=None):
        self.observed += 1
        super().observe_step(layout, batch, measured_s, signature)


def _drive(driver, sched, layout, steps, finish_at=(), switch=True):
    """Boundaries 0..steps-1: the driver decides, the 'engine' switches (or defers), runs, reports."""
    consulted = []
    for step in range(steps):
        before = driver.consults
        want = driver.at_boundary(layout, step, sched)
        if driver.consults > before:
            consulted.append(step)
        if want is not None and switch:
            layout = want[0]
            driver.switched()
        record = StepRecord(step, layout.value, seconds=0.05, requests=len(sched.running), rows=len(sched.running),
                            split_s={"policy": driver.take_policy_s()})
        driver.observe_step(record, [SimpleNamespace(request=r, num_new=1, end=r.num_computed_tokens)
                                     for r in sched.running])
        if step in finish_at:
            done = sched.running.pop()
            done.finish_reason = "length"
            driver.observe_finished([done])
    return consulted, layout


def test_the_driver_consults_only_at_events():
    policy = CountingPolicy(PolicyConfig(min_dwell_steps=1000))
    sched = _scheduler(_req(i) for i in range(8))
    driver = LayoutDriver(policy, config=DriverConfig(decide_every_steps=8, observe_every_steps=4))
    consulted, _ = _drive(driver, sched, Layout.DP, 40, finish_at=(11, 12))
    # the call's first boundary; the one after the stay's third measured step (its evidence may
    # end the dwell); every 8 steps; and the boundary after a quarter of the batch finished (two
    # of 8, at steps 11 and 12; one alone is no event)
    assert consulted == [0, 3, 11, 13, 21, 29, 37], consulted
    # the correction is fed the stay's first dwell_evidence_steps (3) steps and one in
    # observe_every_steps (4) after them: steps 1, 2, 3, 5, 9, ..., 37
    assert len(policy.calls) == len(consulted) and policy.observed == 12
    # admissions: the queue shrinking by a quarter of the batch (2 of 6) makes the next boundary an event
    sched.waiting = [_req(100 + i, ctx=0) for i in range(3)]
    driver.new_call()
    driver.at_boundary(Layout.DP, 100, sched)
    n = driver.consults
    driver.at_boundary(Layout.DP, 101, sched)
    assert driver.consults == n  # nothing changed
    sched.running.append(sched.waiting.pop(0))
    driver.at_boundary(Layout.DP, 102, sched)
    assert driver.consults == n  # one admission of 6 running: not yet
    sched.running.append(sched.waiting.pop(0))
    driver.at_boundary(Layout.DP, 103, sched)
    assert driver.consults == n + 1


def test_a_deferred_switch_is_decided_again_and_logged_once():
    """The policy wants TP from the first boundary on and the engine defers every time: each boundary
    is a new decision (no blind retry), and the timeline keeps the one choice, not every retry."""
    policy = CountingPolicy(PolicyConfig(min_dwell_steps=0), want=Layout.TP)
    sched = _scheduler(_req(i) for i in range(4))
    driver = LayoutDriver(policy, config=DriverConfig(decide_every_steps=1000, observe_every_steps=4))
    consulted, layout = _drive(driver, sched, Layout.DP, 4, switch=False)
    assert consulted == [0, 1, 2, 3] and layout is Layout.DP
    assert [d["chosen"] for d in driver.decision_log] == ["tp"] and driver.pending == (Layout.TP, False)
    _drive(driver, sched, Layout.DP, 1)  # decided once more, and this time the engine moves
    assert driver.pending is None and driver.steps_in_layout == 1
    # the switching step is not the layout's; the next one is the first the correction sees
    seen = policy.observed
    _drive(driver, sched, Layout.TP, 1)
    assert policy.observed == seen + 1


def test_steps_in_layout_counts_steps_and_restarts_at_a_switch():
    driver = LayoutDriver(None)
    rec = StepRecord(0, "dp", seconds=0.01)
    for _ in range(5):
        driver.observe_step(rec, [])
    assert driver.steps_in_layout == 5 and driver.take_policy_s() == 0.0
    driver.switched()
    driver.observe_step(rec, [])
    assert driver.steps_in_layout == 1
    assert np.isclose(driver.take_policy_s(), 0.0)
