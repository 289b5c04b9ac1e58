"""sleep() / wake_up() and the per-step progress hook on 2 ranks: spawned by the RolloutEngine, and
an Engine hosted in-process by the caller's ranks (the torchrun path, run on the shared group)."""
import io

import pytest

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams
from splash_rollout.engine.request import Request, SamplingSpec
from splash_rollout.rollout.progress import RolloutProgress
from splash_rollout.rollout.build import build_engine
from splash_rollout.rollout.ranks import RequestRecord

PROMPTS = [[5, 6, 7] * 10, [9, 10] * 4, [11, 12] * 20]
GREEDY = SamplingParams(n=1, temperature=0.0, max_new_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(n=2, temperature=1.0, top_p=0.9, max_new_tokens=6, seed=3, ignore_eos=True)
# reproducible numerics: the calls after wake_up draft from the earlier calls' responses (speculation
# "auto"), and only there does a verified row round exactly like a decoded one
CONFIG = EngineConfig(model="glm5-nano", world_size=2, layout="dop", memory_budget_gib=0.0625,
                      max_num_batched_tokens=64, page_size=8, numerics="reproducible")


def outputs(batch):
    return [[(s.response_ids, s.response_logprobs) for s in g.samples] for g in batch.groups]


def assert_released_and_restored(awake, asleep, woken):
    for a, s, w in zip(awake, asleep, woken):
        assert a["kv_pool"] > 32 * 2**20 and a["weights"] > 0
        assert s["kv_pool"] == s["weights"] == s["tracked_bytes"] == 0
        assert s["rss"] < a["rss"] - 0.8 * (a["kv_pool"] + a["weights"]), (a, s)
        assert {k: w[k] for k in ("kv_pool", "weights", "tracked_bytes")} == \
            {k: a[k] for k in ("kv_pool", "weights", "tracked_bytes")}


def test_spawned_ranks_sleep_and_wake_with_identical_outputs():
    with RolloutEngine(CONFIG) as engine:
        before = [outputs(engine.generate(PROMPTS, p)) for p in (GREEDY, SEEDED)]
        awake = engine.memory_stats()
        engine.sleep()
        asleep = engine.memory_stats()
        with pytest.raises(RuntimeError, match="asleep.*wake_up"):
            engine.generate(PROMPTS, GREEDY)
        engine.wake_up()
        woken = engine.memory_stats()
        after = [outputs(engine.generate(PROMPTS, p)) for p in (GREEDY, SEEDED)]
    print("spawned, per rank: awake", awake, "asleep", asleep, "woken", woken)
    assert len(awake) == 2
    assert_released_and_restored(awake, asleep, woken)
    assert after == before


def _records(first_id: int) -> list[RequestRecord]:
    spec = SamplingSpec(temperature=1.0, top_p=0.9, max_new_tokens=6, ignore_eos=True, seed=11)
    return [RequestRecord.of(Request(first_id + i, list(p), spec, 256, (1,))) for i, p in enumerate(PROMPTS)]


def _in_process(ctx, config):
    """What every torchrun rank does through RolloutEngine: build, serve, sleep, wake, serve."""
    engine = build_engine(config, ctx.groups)
    events = []
    bar = RolloutProgress(len(PROMPTS), enabled=ctx.rank == 0, file=io.StringIO())
    on_step = lambda e: (events.append(e), bar.on_step(e))  # noqa: E731
    first = engine.serve([r.request() for r in _records(0)], on_step=on_step)
    first_events = list(events)
    awake = engine.memory_stats()
    engine.sleep()
    asleep = engine.memory_stats()
    try:
        engine.serve(None)
        refused = None
    except RuntimeError as e:
        refused = str(e)
    engine.wake_up()
    woken = engine.memory_stats()
    second = engine.serve([r.request() for r in _records(0)], on_step=on_step)
    drawn = bar._bar.fp.getvalue() if bar._bar is not None else ""
    bar.close()
    return {"first": first, "second": second, "events": first_events, "stats": (awake, asleep, woken),
            "refused": refused, "bar": (bar.done, bar.tokens, drawn)}


def test_in_process_group_engine_sleeps_wakes_and_reports_every_step(group2):
    out = group2.run(_in_process, CONFIG)
    r0 = out[0]
    assert [(r.output_ids, r.output_logprobs) for r in r0["second"]] == \
        [(r.output_ids, r.output_logprobs) for r in r0["first"]]
    assert all("asleep" in o["refused"] for o in out)
    assert_released_and_restored(*zip(*[o["stats"] for o in out]))
    events = r0["events"]
    assert events and out[1]["events"] == []  # the driver (rank 0) alone reports
    assert [e.step for e in events] == sorted(e.step for e in events)
    assert all(e.total == len(PROMPTS) for e in events)
    assert [e.done for e in events] == sorted(e.done for e in events) and events[-1].done == len(PROMPTS)
    assert sum(e.new_tokens for e in events) == len(PROMPTS) * 6
    done, tokens, drawn = r0["bar"]
    assert done == len(PROMPTS) and tokens == 2 * len(PROMPTS) * 6  # two calls through one bar
    assert f"{len(PROMPTS)}/{len(PROMPTS)}" in drawn and "layout=dop" in drawn
