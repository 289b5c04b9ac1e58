"""Each layout's per-step traffic is what ``layout/traffic.py`` states: every rank runs real steps
(chunked prefill and decode of a mixed batch, requests owned unevenly), counts the bytes each
collective of the compute group moved, and compares them, per (tag, collective) and per rank, with
the executor's account summed over the layers -- under fast and reproducible numerics (float64
partial sums), with sharded and replicated feed-forward weights, on a DSA model (CP's score
gather) and a DeepSeek-V3-shaped MoE one. The cost model prices the same account."""
from __future__ import annotations

import pytest

from splash_rollout.layout.traffic import TAGS, step_totals
from splash_rollout.models.numerics import numerics
from tests.distributed.layout_cases import MODELS, build_group_engine, make_requests


def measured_against_account(ctx, model: str, layout: str, feed_forward: str, mode: str) -> list[str]:
    """Every rank: the steps whose bytes differ from the account (an empty list: none), and how."""
    cfg = MODELS[model]
    layers = cfg.num_layers
    indexer_layers = sum(map(cfg.layer_has_indexer_cache, range(layers))) if cfg.has_indexer else 0
    with numerics(mode):
        engine = build_group_engine(ctx, model, layout, feed_forward=feed_forward)
        batches = []
        build = engine._batch
        engine._batch = lambda *args: batches.append(build(*args)) or batches[-1]  # a spy: the real batch
        engine.serve(make_requests(model, new_tokens=3)[:5], max_steps=1)
        problems, steps = [], 0
        while engine.scheduler.has_unfinished and steps < 8:
            engine.comm.counter.reset()
            engine.serve(None, max_steps=1)
            steps += 1
            account = step_totals(engine.step_traffic(batches[-1]), layers, indexer_layers)
            t, r = ctx.world_size, ctx.rank
            moved = {key: both for key, both in engine.comm.counter.by_op.items() if key[0] in TAGS and any(both)}
            stated = {key: [v[r], v[t + r]] for key, v in account.items() if v[r] or v[t + r]}
            if moved != stated:
                problems.append(f"rank {r} step {steps} ({batches[-1].num_tokens} rows, owners "
                                f"{batches[-1].owners}): moved {moved}, stated {stated}")
        engine.abort_all()
    return problems + ([] if steps >= 3 else [f"rank {ctx.rank}: only {steps} steps ran"])


@pytest.mark.parametrize("model,layout,feed_forward,mode", [
    ("glm5-nano", "tp", "sharded", "fast"), ("glm5-nano", "dp", "sharded", "reproducible"),
    ("glm5-nano", "dop", "sharded", "fast"), ("glm5-nano", "cp", "sharded", "reproducible"),
    ("tiny-v3", "dop", "sharded", "reproducible"), ("tiny-v3", "cp", "sharded", "fast"),
    ("tiny-v3", "tp", "replicated", "fast"), ("glm5-nano", "dp", "replicated", "fast"),
])
def test_each_collective_moves_the_bytes_its_executor_states(group2, model, layout, feed_forward, mode):
    problems = [p for rank in group2.run(measured_against_account, model, layout, feed_forward, mode) for p in rank]
    assert not problems, "\n".join(problems)
