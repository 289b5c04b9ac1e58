"""Per-layout step latency on T CPU ranks over a grid of batch size x context (prefill and decode).

Every rank builds one Engine per layout (each on its own copy of the same weights). For every grid point, ``repeats``
rounds run; each round serves a fresh batch of B requests with ``context``-token prompts in every
layout back to back, so a burst of load from other processes hits all layouts alike instead of
whichever layout happened to run then. The first step of a batch prefills every prompt at once (the
token budget holds them all), the next steps decode one row per request. Reported per layout and
point: the median prefill step and the median decode step over the rounds, timed on the driver
(collectives make every rank's step equally long). ``calibrate`` fits the cost model's constants on
one grid of this; ``bench costmodel`` checks them on another.
"""
from __future__ import annotations

import statistics

import torch

from splash_rollout.engine.rank_engine import Engine
from splash_rollout.rollout.build import engine_settings
from splash_rollout.rollout.config import EngineConfig
from splash_rollout.engine.request import Request, SamplingSpec
from splash_rollout.engine.step_log import StepRecord
from splash_rollout.models.config import resolve_model
from splash_rollout.models.model import MLAForCausalLM
from splash_rollout.models.numerics import set_numerics

DECODE_STEPS = 6


def bench_on_rank(ctx, model: str, layouts: str | list[str], batches: list[int], contexts: list[int],
                  page_size: int = 16, repeats: int = 3, seed: int = 0, numerics: str = "fast",
                  attention_backend: str = "torch") -> list[dict] | None:
    """Every rank: run the grid in each of ``layouts`` (one name or several, interleaved per round)
    under ``numerics`` (models/numerics.py); rank 0 returns one record per layout and grid point
    (``{"layout", "batch", "context", "repeats", "prefill_ms", "decode_ms"}``), others None."""
    torch.set_flush_denormal(True)
    set_numerics(numerics)
    names = [layouts] if isinstance(layouts, str) else list(layouts)
    cfg = resolve_model(model)
    most = max(batches) * (max(contexts) + DECODE_STEPS + page_size)
    # each engine shards its own copy of the model (same seed: same weights)
    settings = {name: engine_settings(EngineConfig(
        model=cfg, parallel=dict(world_size=ctx.world_size, layout=name),
        memory=dict(num_pages=most // page_size + max(batches) + 1, page_size=page_size),
        batching=dict(max_num_batched_tokens=max(batches) * max(contexts), max_num_seqs=max(batches)),
        compute=dict(attention_backend=attention_backend, speculation="off"))) for name in names}
    engines = {name: Engine(MLAForCausalLM.from_config(cfg, seed=0).eval(), cfg, ctx.groups, settings[name])
               for name in names}

    def run(engine: Engine, b: int, s: int, draw: int) -> list[StepRecord] | None:
        g = torch.Generator().manual_seed(seed * 7919 + b * 100003 + s * 31 + draw)  # the same requests on every rank
        reqs = [Request(i, torch.randint(3, cfg.vocab_size, (s,), generator=g).tolist(),
                        SamplingSpec(temperature=0.0, max_new_tokens=DECODE_STEPS + 1, ignore_eos=True),
                        cfg.max_position_embeddings) for i in range(b)]
        engine.step_log.clear()
        engine.serve(reqs)
        return list(engine.step_log) if ctx.rank == 0 else None

    for engine in engines.values():  # warm-up: first calls allocate and fill caches
        run(engine, min(batches), min(contexts), -1)
    points = []
    for b in batches:
        for s in contexts:
            logs = {name: [] for name in names}
            for draw in range(repeats):
                for name, engine in engines.items():
                    logs[name].append(run(engine, b, s, draw))
            if ctx.rank == 0:
                for name in names:
                    points.append({"layout": name, "batch": b, "context": s, "repeats": repeats,
                                   "prefill_ms": 1e3 * statistics.median(log[0].seconds for log in logs[name]),
                                   "decode_ms": 1e3 * statistics.median(x.seconds for log in logs[name]
                                                                         for x in log[1:])})
    return points if ctx.rank == 0 else None
