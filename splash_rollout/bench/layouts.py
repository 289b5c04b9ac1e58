"""Per-layout step latency on T CPU ranks over a grid of batch size x context (prefill and decode).

For every layout and grid point a fresh batch of B requests with ``context``-token prompts runs on
a spawned group: the first step prefills every prompt at once (the token budget holds them all),
the next steps decode one row per request. Reported: the prefill step's time and the median decode
step's time, measured on the driver (collectives make every rank's step equally long).
"""
from __future__ import annotations

import statistics

import torch

from splash_rollout.engine.group_engine import GroupEngine
from splash_rollout.engine.request import Request, SamplingSpec
from splash_rollout.layout.layouts import Layout
from splash_rollout.models.config import resolve_model
from splash_rollout.models.model import MLAForCausalLM

DECODE_STEPS = 6


def bench_on_rank(ctx, model: str, layout: str, batches: list[int], contexts: list[int], page_size: int = 16) -> list[dict] | None:
    """Every rank: run the grid in one layout; rank 0 returns one record per grid point."""
    torch.set_flush_denormal(True)
    cfg = resolve_model(model)
    most = max(batches) * (max(contexts) + DECODE_STEPS + page_size)
    engine = GroupEngine(MLAForCausalLM.from_config(cfg, seed=0).eval(), cfg, ctx.groups, layout=Layout.parse(layout),
                         num_pages=most // page_size + max(batches) + 1, page_size=page_size,
                         max_num_batched_tokens=max(batches) * max(contexts), max_num_seqs=max(batches))
    points = []
    for b in batches:
        for s in contexts:
            reqs = None
            if ctx.rank == 0:
                g = torch.Generator().manual_seed(b * 100003 + s)
                reqs = [Request(i, torch.randint(3, cfg.vocab_size, (s,), generator=g).tolist(),
                                SamplingSpec(temperature=0.0, max_new_tokens=DECODE_STEPS + 1, ignore_eos=True),
                                cfg.max_position_embeddings) for i in range(b)]
                engine.step_log.clear()
            engine.serve(reqs)
            if ctx.rank == 0:
                log = engine.step_log
                points.append({"layout": layout, "batch": b, "context": s,
                               "prefill_ms": 1e3 * log[0]["seconds"],
                               "decode_ms": 1e3 * statistics.median(x["seconds"] for x in log[1:])})
    return points if ctx.rank == 0 else None
