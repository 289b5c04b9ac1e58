"""Reliability of a 2-rank spawned RolloutEngine: nothing lost, aborts, rank failures.

* Property test: random request mixes (prompt lengths, n, max_new_tokens, stop tokens), random
  switch schedules and aborts; every sample comes back exactly once with a finish reason that fits
  its tokens, and after every call no KV page is held or reserved on any rank (and each rank's
  physical pool matches the driver's page count for the layout it ended in).
* 50 calls with a layout switch in each: no growth.
* A rank killed mid-rollout, and a failure injected into a switch transfer (distributed/faults.py): the
  caller gets a clear error within the rank timeout, never a hang; the engine then refuses every
  call and says why; a new engine in the same process generates correctly.
Bad input to one rank is in tests/unit/test_bad_input.py; torchrun ranks in torchrun_reliability.py.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams
from splash_rollout.distributed.launch import RankFailure
from splash_rollout.layout.layouts import Layout
from splash_rollout.models.config import PRESETS
from tests.rollout_checks import assert_every_sample_once

CFG = dict(model="glm5-nano", world_size=2, page_size=8, max_num_batched_tokens=64, memory_budget_gib=0.005)
LAYOUTS = [layout.value for layout in Layout]
PROMPTS = [[5, 6, 7] * 10, [9] * 3, [11, 12] * 13, [4] * 20]
SEEDED = SamplingParams(n=2, max_new_tokens=8, seed=5, ignore_eos=True)


# ---- run on the spawned ranks (module level, so they pickle by name) ---------------------------
def page_stats(ctx) -> dict:
    """Rank 0: the driver's page managers once the prefix cache has let its pages go (every replica
    alike); every rank: its physical pool size."""
    engine = ctx.state["engine"]
    engine.scheduler.clear_cache()
    out = {"pool_pages": engine.state.pool.num_pages, "num_steps": engine.num_steps}
    if ctx.rank == 0:
        placement = engine.scheduler.placement
        out.update(layout=engine.layout.value, unfinished=engine.scheduler.has_unfinished,
                   pages=[m.num_pages for m in placement.managers], free=[m.num_free for m in placement.managers],
                   used=placement.pages_in_use, references=[m.num_references for m in placement.managers],
                   projected=list(placement.projected_tokens), pending_switch=engine.driver.pending)
    return out


def set_switch_schedule(ctx, relative: dict[int, str]) -> None:
    """Rank 0: switch at these steps counted from now (replaces the config's schedule; a test hook)."""
    engine = ctx.state["engine"]
    engine.driver.switch_schedule = {engine.num_steps + k: Layout.parse(v) for k, v in relative.items()}


# ---- helpers -------------------------------------------------------------------------------------
def assert_nothing_held(engine: RolloutEngine) -> dict:
    stats = engine.worker_group.run(page_stats)
    s = stats[0]
    assert not s["unfinished"]
    assert s["used"] == [0, 0] and s["references"] == [0, 0] and s["projected"] == [0, 0], s
    assert s["free"] == s["pages"], s
    assert [r["pool_pages"] for r in stats] == s["pages"], (stats, "a rank's pool disagrees with the driver")
    return s


class AbortAt:
    """Calls engine.abort() from another thread: once the driver reports ``steps`` steps of the
    running call (``base_step``: its step count before), or ``delay_s`` after the call starts."""

    def __init__(self, engine: RolloutEngine, steps: int | None = None, base_step: int = 0, delay_s: float = 0.0):
        self.engine, self.result, self.delay_s = engine, None, delay_s
        self.target = None if steps is None else base_step + steps
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set() and (self.engine._in_call is None or self.target is not None and
                                          self.engine.worker_group.progress.get(0, {}).get("step", -1) < self.target):
            time.sleep(0.002)
        if self.done.wait(self.delay_s):
            return
        self.result = self.engine.abort()  # 0 if the call ended meanwhile

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


@pytest.fixture(scope="module")
def engine():
    with RolloutEngine(EngineConfig(layout="tp", **CFG)) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference():
    """The same seeded requests on one rank (what every layout must reproduce)."""
    with RolloutEngine(EngineConfig(model="glm5-nano", page_size=8, max_num_batched_tokens=64)) as one:
        return [s.response_ids for s in one.generate(PROMPTS, SEEDED).samples]


# ---- nothing lost --------------------------------------------------------------------------------
request = st.tuples(st.integers(1, 40), st.integers(1, 3), st.integers(1, 12), st.integers(0, 80),
                    st.integers(0, 511), st.booleans())


@settings(max_examples=16, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(reqs=st.lists(request, min_size=1, max_size=6),
       schedule=st.dictionaries(st.integers(0, 8), st.sampled_from(LAYOUTS), max_size=3),
       abort_after_s=st.none() | st.sampled_from([0.0, 0.05, 0.15, 0.3]), data=st.data())
def test_every_sample_comes_back_once_whatever_the_mix_switches_and_aborts(engine, reqs, schedule, abort_after_s,
                                                                          data):
    prompts = [data.draw(st.lists(st.integers(0, 511), min_size=n, max_size=n)) for n, *_ in reqs]
    params = [SamplingParams(n=n, max_new_tokens=new, stop_token_ids=tuple(range(lo, min(512, lo + width))),
                             ignore_eos=ignore, temperature=1.0)
              for (_, n, new, width, lo, ignore) in reqs]
    engine.worker_group.run(set_switch_schedule, schedule)
    aborter = AbortAt(engine, delay_s=abort_after_s) if abort_after_s is not None else None
    try:
        batch = engine.generate(prompts, params)
    finally:
        if aborter is not None:
            aborter.stop()
        engine.worker_group.run(set_switch_schedule, {})
    assert_every_sample_once(batch, prompts, params, aborted_ok=bool(aborter and aborter.result))
    if aborter is not None and aborter.result:  # the abort landed while the call ran
        assert aborter.result == sum(p.n for p in params)
    stats = assert_nothing_held(engine)
    done = [s for s in batch.timeline.switches if s["deferred_reason"] is None]
    event(f"switches done: {min(len(done), 2)}+, aborted samples: {any(s.finish_reason == 'abort' for s in batch.samples)}")
    assert all(sw["src"] != sw["dst"] for sw in done)
    if done:
        assert stats["layout"] == done[-1]["dst"] or stats["pending_switch"] is not None


def test_fifty_calls_with_switches_leave_no_page_behind(engine):
    first = assert_nothing_held(engine)
    for call in range(50):
        engine.worker_group.run(set_switch_schedule, {1: LAYOUTS[call % 4]})
        params = SamplingParams(n=1 + call % 2, max_new_tokens=1 + call % 4, ignore_eos=True)
        batch = engine.generate([[3 + call] * (1 + call % 9), [7] * 5], params)
        assert all(s.finish_reason == "length" for s in batch.samples)
        stats = assert_nothing_held(engine)
        assert stats["pages"] == engine.worker_group.run(page_stats)[0]["pages"]
    engine.worker_group.run(set_switch_schedule, {})
    engine.switch_layout(first["layout"])
    engine.generate([[3]], SamplingParams(max_new_tokens=1))
    assert assert_nothing_held(engine)["pages"] == first["pages"]  # same layout, same pool as 50 calls ago


def test_ten_sleep_wake_cycles_leave_no_page_or_byte_behind(engine, reference):
    first = assert_nothing_held(engine)
    awake = [(m["kv_pool"], m["weights"]) for m in engine.memory_stats()]
    for cycle in range(10):
        engine.worker_group.run(set_switch_schedule, {1: LAYOUTS[cycle % 4]})
        batch = engine.generate([[3 + cycle] * 5, [7] * 9], SamplingParams(n=2, max_new_tokens=3, ignore_eos=True))
        assert len(batch.samples) == 4 and all(s.finish_reason == "length" for s in batch.samples)
        engine.worker_group.run(set_switch_schedule, {})
        engine.sleep()
        assert all(m["kv_pool"] == 0 for m in engine.memory_stats())
        engine.wake_up()
        assert_nothing_held(engine)
        if cycle % 4 == 3:  # back in the first layout: the same pools and weights as before the cycles
            engine.switch_layout(first["layout"])
            engine.generate([[3]], SamplingParams(max_new_tokens=1))
            assert assert_nothing_held(engine)["pages"] == first["pages"]
            assert [(m["kv_pool"], m["weights"]) for m in engine.memory_stats()] == awake
    engine.switch_layout("tp")
    assert [s.response_ids for s in engine.generate(PROMPTS, SEEDED).samples] == reference


def test_abort_stops_a_group_call_at_a_step_boundary(engine, reference):
    assert engine.abort() == 0  # no call running: nothing is kept for later
    base = engine.worker_group.run(page_stats)[0]["num_steps"]
    aborter = AbortAt(engine, steps=3, base_step=base)
    params = SamplingParams(n=2, max_new_tokens=400, ignore_eos=True)
    try:
        batch = engine.generate(PROMPTS, params)
    finally:
        aborter.stop()
    assert aborter.result == 8
    assert_every_sample_once(batch, PROMPTS, [params] * 4, aborted_ok=True)
    assert {s.finish_reason for s in batch.samples} == {"abort"}
    assert_nothing_held(engine)
    engine.switch_layout("tp")
    again = engine.generate(PROMPTS, SEEDED)  # the abort is not sticky, and the engine still serves
    assert [s.response_ids for s in again.samples] == reference


def test_bad_weight_push_keeps_the_old_weights_on_every_rank(engine):
    greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    before = [s.response_ids for s in engine.generate(PROMPTS, greedy).samples]
    from splash_rollout.models.model import MLAForCausalLM

    new = MLAForCausalLM.from_config(PRESETS["glm5-nano"], seed=99).state_dict()
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    lossy = new[name].double() * (1 + 1e-9)  # float64 values float32 would round (an exact cast is accepted)
    for push, message in [({**new, name: lossy}, rf"{name}: expected dtype torch.float32, got torch.float64, and"),
                          ({**new, name: torch.full_like(new[name], float("nan"))}, rf"{name}: \d+ of its \d+ values are NaN"),
                          ({**new, name: new[name][:, :1]}, rf"{name}: has shape .* a shard"),
                          ({**new, name: new[name].t()}, rf"{name}: expected shape"),
                          ({**new, "lm_head.bias": torch.zeros(512)}, r"unknown parameter names \['lm_head.bias'\]")]:
        with pytest.raises(ValueError, match=message):
            engine.update_weights(push, version=7)
    assert engine.weight_version == 0
    assert [s.response_ids for s in engine.generate(PROMPTS, greedy).samples] == before


# ---- faults --------------------------------------------------------------------------------------
def busy(ctx, seconds: float, beat: bool) -> int:
    """Work for ``seconds``, with or without heartbeats."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if beat:
            ctx.heartbeat({"left": end - time.monotonic()}, min_interval_s=0.0)
        time.sleep(0.05)
    return ctx.rank


def test_the_timeout_bounds_silence_not_the_length_of_a_call(group2):
    assert group2.run(busy, 0.0, False) == [0, 1]  # the ranks import this module first (not timed)
    assert group2.run(busy, 2.5, True, timeout_s=1.0) == [0, 1]  # longer than the timeout, but alive
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"busy: ranks \[0, 1\] did not answer \(no result and no heartbeat\) "
                                          r"within 1 s"):
        group2.run(busy, 2.5, False, timeout_s=1.0)  # a stuck rank: an error, not a hang
    assert time.monotonic() - start < 1.0 + 10
    assert group2.run(busy, 0.0, False) == [0, 1]  # the group still serves (the late answer is dropped)


def _kill_when_serving(engine: RolloutEngine, rank: int, steps: int) -> dict:
    """Kill ``rank`` with SIGKILL once the driver reports ``steps`` steps of the running call."""
    out = {}

    def run() -> None:
        while engine.worker_group.progress.get(0, {}).get("step", 0) < steps:
            time.sleep(0.005)
        out["at"] = time.monotonic()
        os.kill(engine.worker_group.pids[rank], signal.SIGKILL)

    threading.Thread(target=run, daemon=True).start()
    return out


def test_a_rank_killed_mid_rollout_is_a_clear_error_and_a_new_engine_starts(reference):
    timeout = 10.0
    eng = RolloutEngine(EngineConfig(layout="dp", rank_timeout_s=timeout, **CFG))
    assert [s.response_ids for s in eng.generate(PROMPTS, SEEDED).samples] == reference
    steps = eng.worker_group.run(page_stats)[0]["num_steps"]
    killed = _kill_when_serving(eng, 1, steps + 3)
    with pytest.raises(RankFailure, match=r"rank 1 died during worker_serve \(exit code -9\)"):
        eng.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=400, ignore_eos=True))
    assert time.monotonic() - killed["at"] < timeout + 15  # noticed by polling; the bound is the timeout
    with pytest.raises(RuntimeError, match=r"generate: this RolloutEngine is unusable after a failure on its ranks "
                                           r"\(worker_serve: RankFailure: rank 1 died.*build a new RolloutEngine"):
        eng.generate(PROMPTS, SEEDED)
    with pytest.raises(RuntimeError, match=r"update_weights: this RolloutEngine is unusable"):
        eng.update_weights({})
    eng.shutdown()  # clean: nothing raises, no worker is left
    assert not eng.worker_group.alive and None not in eng.worker_group.exit_codes  # reaped
    with RolloutEngine(EngineConfig(layout="dp", rank_timeout_s=timeout, **CFG)) as fresh:
        assert [s.response_ids for s in fresh.generate(PROMPTS, SEEDED).samples] == reference


@pytest.mark.parametrize("rank", [1, 0], ids=["worker", "driver"])
def test_a_failed_switch_transfer_aborts_the_call_and_no_half_moved_state_is_used(rank, monkeypatch):
    """DP -> TP at step 3: projections are cut out of the replicated ones (a discard), KV rows travel.
    The fault fires on one rank after layer 1's new shard is installed, before its KV arrives."""
    timeout = 10.0
    monkeypatch.setenv("SPLASH_FAULT", f"switch_transfer:1@{rank}")  # the spawned ranks inherit it
    eng = RolloutEngine(EngineConfig(layout="dp", rank_timeout_s=timeout, switch_schedule={3: "tp"}, **CFG))
    monkeypatch.delenv("SPLASH_FAULT")
    try:
        start = time.monotonic()
        with pytest.raises(RankFailure, match=rf"rank {rank} raised during worker_serve:(.|\n)*InjectedFault: "
                                              rf"SPLASH_FAULT=switch_transfer:1@{rank}: injected failure in "
                                              rf"switch_transfer of layer 1 on rank {rank}"):
            eng.generate(PROMPTS, SEEDED)
        assert time.monotonic() - start < timeout + 30
        assert not eng.worker_group.alive  # the half-moved ranks are gone, not waiting to be used
        with pytest.raises(RuntimeError, match=r"unusable after a failure on its ranks .*InjectedFault"):
            eng.generate(PROMPTS, SEEDED)
        with pytest.raises(RuntimeError, match=r"switch_layout: this RolloutEngine is unusable"):
            eng.switch_layout("dp")
    finally:
        eng.shutdown()


# ---- torchrun --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_torchrun_ranks_with_different_prompts_all_raise(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    env.pop("SPLASH_FAULT", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                           "tests/distributed/torchrun_reliability.py", str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"out.rank{r}.json").read_text()) for r in (0, 1))
    # different prompts: the same error on both ranks, before any work
    assert r0["mismatch"] == r1["mismatch"]
    assert r0["mismatch"].startswith("ValueError: prompts: expected the same prompts and sampling on every rank")
    # a bad prompt on rank 1 only: rank 1 says what is wrong, rank 0 that rank 1 rejected its input
    assert r1["bad_on_one"].startswith("ValueError: prompts[0]: token ids [9999] outside the vocabulary")
    assert r0["bad_on_one"].startswith("ValueError: generate: rank 1 rejected its input (ValueError: prompts[0]")
    # then the ranks still agree and serve, with the seed counters where they were
    assert r0["good"] == r1["good"] == r0["fresh"]
    # a failure injected on rank 1 in a switch transfer: an error on both ranks, then both refuse
    assert "InjectedFault" in r1["fault"] and r0["fault"]  # rank 0: its collective broke or timed out
    assert r0["fault_s"] < r0["timeout_s"] + 30
    for r in (r0, r1):
        assert "this RolloutEngine is unusable after a failure on its ranks" in r["after_fault"]
