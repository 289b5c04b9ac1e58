"""Requests that arrive while others run (``RolloutEngine.submit``): the samples ``generate`` gives for
the same seeds, whatever ran beside them; a short request sent while a long one runs ends first;
streamed tokens add up to the result; one request aborts alone; ``generate`` joins what the loop runs."""
from __future__ import annotations

import asyncio
import threading

import pytest

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams

CONFIG = EngineConfig(model="glm5-nano", memory={"num_pages": 256}, compute={"numerics": "reproducible",
                                                                             "speculation": "off"})
PROMPTS = [[5 + i, 6, 7, 8, 9 + i] * (1 + i % 3) for i in range(6)]


def _params(i: int, new: int = 12) -> SamplingParams:
    return SamplingParams(n=2, temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=100 + i)


@pytest.fixture(scope="module")
def reference():
    with RolloutEngine(CONFIG) as engine:
        batch = engine.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))])
    return [[(s.response_ids, s.response_logprobs) for s in g.samples] for g in batch.groups]


def test_submitted_from_many_threads_equal_generate(reference):
    with RolloutEngine(CONFIG) as engine:
        handles = [None] * len(PROMPTS)

        def submit(i):
            handles[i] = engine.submit(PROMPTS[i], _params(i))

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        got = [[(s.response_ids, s.response_logprobs) for s in h.result(120).samples] for h in handles]
    assert got == reference


def test_a_short_request_sent_while_a_long_one_runs_ends_first():
    with RolloutEngine(CONFIG) as engine:
        long = engine.submit(PROMPTS[0], SamplingParams(max_new_tokens=200, ignore_eos=True, seed=1))
        while not long.first_token_at:  # the long one is decoding
            threading.Event().wait(0.01)
        short = engine.submit(PROMPTS[1], SamplingParams(max_new_tokens=3, ignore_eos=True, seed=2))
        short.result(60)
        assert not long.done
        assert len(long.result(120).samples[0].response_ids) == 200


def test_streamed_tokens_add_up_and_one_request_aborts_alone(reference):
    async def run(engine):
        keep = engine.submit(PROMPTS[2], _params(2))
        cut = engine.submit(PROMPTS[3], SamplingParams(max_new_tokens=400, ignore_eos=True, seed=7))
        pieces: dict[int, list[int]] = {0: [], 1: []}
        reasons = {}
        async for delta in keep.stream():
            pieces[delta.sample] += delta.token_ids
            if delta.finish_reason:
                reasons[delta.sample] = delta.finish_reason
        assert engine.abort_requests(cut.request_ids) == 1
        aborted = await cut
        return await keep, pieces, reasons, aborted

    with RolloutEngine(CONFIG) as engine:
        group, pieces, reasons, aborted = asyncio.run(run(engine))
    assert [pieces[0], pieces[1]] == [s.response_ids for s in group.samples]
    assert reasons == {0: "length", 1: "length"}
    assert [(s.response_ids, s.response_logprobs) for s in group.samples] == reference[2]
    assert aborted.samples[0].finish_reason == "abort" and len(aborted.samples[0].response_ids) < 400


def test_generate_joins_what_the_loop_runs(reference):
    with RolloutEngine(CONFIG) as engine:
        long = engine.submit(PROMPTS[5], SamplingParams(max_new_tokens=100, ignore_eos=True, seed=3))
        batch = engine.generate(PROMPTS[:2], [_params(0), _params(1)])  # served beside the long request
        assert not long.done or len(long.result().samples[0].response_ids) == 100
        got = [[(s.response_ids, s.response_logprobs) for s in g.samples] for g in batch.groups]
        assert batch.metrics["perf/steps"] > 0
        long.result(120)
    assert got == reference[:2]


def test_submit_refuses_bad_input_by_field_and_keeps_serving():
    with RolloutEngine(CONFIG) as engine:
        with pytest.raises(ValueError, match="vocab"):
            engine.submit([5, 10_000], SamplingParams(max_new_tokens=2))
        with pytest.raises(ValueError, match="max_new_tokens"):
            engine.submit([5, 6], SamplingParams(max_new_tokens=0))
        assert len(engine.submit([5, 6], SamplingParams(max_new_tokens=2)).result(60).samples[0].response_ids) == 2


def test_a_request_no_pool_holds_is_refused_at_the_next_step_and_the_rest_run():
    small = EngineConfig(model="glm5-nano", memory={"num_pages": 8}, compute={"speculation": "off"})
    with RolloutEngine(small) as engine:
        running = engine.submit([5, 6, 7], SamplingParams(max_new_tokens=30, ignore_eos=True, seed=1))
        too_big = engine.submit([5, 6, 7], SamplingParams(n=2, max_new_tokens=200, ignore_eos=True, seed=2))
        with pytest.raises(ValueError, match="needs 13 KV pages"):
            too_big.admitted(60)
        with pytest.raises(ValueError, match="KV pages"):
            too_big.result(0)
        assert running.admitted(60) and len(running.result(60).samples[0].response_ids) == 30
        assert engine.requests_in_flight == 0


def test_a_stream_opened_late_replays_what_came_before():
    async def run(engine):
        handle = engine.submit(PROMPTS[4], _params(4))
        while len(handle._tokens[0]) < 3:  # some tokens already out before anyone listens
            await asyncio.sleep(0.005)
        pieces = {0: [], 1: []}
        async for delta in handle.stream():
            pieces[delta.sample] += delta.token_ids
        return await handle, pieces

    with RolloutEngine(CONFIG) as engine:
        group, pieces = asyncio.run(run(engine))
    assert [pieces[0], pieces[1]] == [s.response_ids for s in group.samples]
