"""Switch overhead on T CPU ranks: blocking, overlapped and target-ready step times (paper Table 1).

For each unordered pair of layouts a batch of B requests is prefilled to ``context`` tokens, then
decode steps alternate: a switching step A→B (overlapped or blocking), a target-ready step already
in B, the switching step B→A, a target-ready step in A — so every directed switch is measured
``runs`` times on live histories. ΔT is a switching step's time minus the median target-ready time
of its destination.
"""
from __future__ import annotations

import statistics
from itertools import combinations

import torch

from splash_rollout.engine.rank_engine import Engine
from splash_rollout.rollout.build import engine_settings
from splash_rollout.rollout.config import EngineConfig
from splash_rollout.engine.request import Request, SamplingSpec
from splash_rollout.layout.layouts import ALL_LAYOUTS
from splash_rollout.models.config import resolve_model
from splash_rollout.models.model import MLAForCausalLM


def _p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def bench_switch_on_rank(ctx, model: str, batch: int, context: int, runs: int, page_size: int = 16) -> list[dict] | None:
    torch.set_flush_denormal(True)
    cfg = resolve_model(model)
    out = []
    for a, b in combinations(ALL_LAYOUTS, 2):
        settings = engine_settings(EngineConfig(
            model=cfg, parallel=dict(world_size=ctx.world_size, layout=a.value),
            memory=dict(num_pages=batch * (context + 8 * runs + 64) // page_size + batch, page_size=page_size),
            batching=dict(max_num_batched_tokens=batch * context, max_num_seqs=batch), compute=dict(speculation="off")))
        engine = Engine(MLAForCausalLM.from_config(cfg, seed=0).eval(), cfg, ctx.groups, settings)
        g = torch.Generator().manual_seed(11)  # the same requests on every rank
        reqs = [Request(i, torch.randint(3, cfg.vocab_size, (context,), generator=g).tolist(),
                        SamplingSpec(temperature=0.0, max_new_tokens=10 * runs, ignore_eos=True),
                        cfg.max_position_embeddings) for i in range(batch)]
        engine.serve(reqs, max_steps=1)  # prefill all
        times: dict[tuple, list[float]] = {}
        for blocking in (False, True):
            for _ in range(runs):
                for src, dst in ((a, b), (b, a)):
                    for mode in ("switch", "ready"):
                        if ctx.rank == 0 and mode == "switch":
                            engine.request_switch(dst, blocking)
                            engine.step_log.clear()
                        elif ctx.rank == 0:
                            engine.step_log.clear()
                        engine.serve(None, max_steps=1)
                        if ctx.rank == 0:
                            key = (src.value, dst.value, ("blocking" if blocking else "overlapped") if mode == "switch"
                                   else "ready")
                            times.setdefault(key, []).append(1e3 * engine.step_log[-1].seconds)
        if ctx.rank == 0:
            for src, dst in ((a, b), (b, a)):
                ready = times[(src.value, dst.value, "ready")]
                rec = {"src": src.value, "dst": dst.value, "ready_p50_ms": _p(ready, 0.5),
                       "ready_p95_ms": _p(ready, 0.95)}
                for mode in ("overlapped", "blocking"):
                    t = times[(src.value, dst.value, mode)]
                    delta = [x - statistics.median(ready) for x in t]
                    rec.update({f"{mode}_p50_ms": _p(t, 0.5), f"{mode}_p95_ms": _p(t, 0.95),
                                f"{mode}_overhead_p50_ms": _p(delta, 0.5), f"{mode}_overhead_p95_ms": _p(delta, 0.95)})
                b_over, o_over = rec["blocking_overhead_p50_ms"], rec["overlapped_overhead_p50_ms"]
                rec["overhead_reduction"] = (1 - o_over / b_over) if b_over > 0 else None
                out.append(rec)
        engine.serve(None)  # drain
    return out if ctx.rank == 0 else None
