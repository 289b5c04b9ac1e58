"""Capacity and admission per layout under one memory budget: where DOP admits more than DP.

Every layout gets the same per-rank budget for attention weights plus KV (``memory_budget_gib`` of
EngineConfig); the KV pool is what the layout's attention weights leave (layout/footprint.py):
TP and DOP shard the Q-B / KV-B / O projections (W_A / T per rank), DP-attention and CP replicate
them (W_A per rank). Ownership then decides what one request costs: TP stores every history on every
rank, DP and DOP on one owner rank, CP spreads its pages over the ranks. Admission reserves a
request's worst case (prompt + max_new_tokens), so the number of requests running at once is set
by the pool alone.

For each layout (and ``auto``) the script builds the engine exactly as ``RolloutEngine`` does
(``rollout.build.build_engine``) on spawned ranks, serves ``--requests`` identical requests
and reads the step log: the largest running batch, steps and wall time. It also reports the
ownership model's pool tokens per rank and distinct tokens per group, and the concurrency the
admission rule predicts on empty pools (``KVPlacement``), which the measured one must equal.

glm5-nano's switchable attention weights are small (1.4 MB in float32, about 800 tokens of KV per
rank), so the DOP-vs-DP difference shows only when the budget is a few MiB; the default budget
(2.5 MiB per rank) is picked for that. Real models have W_A of GBs: see
``python -m splash_rollout.layout`` for their footprints.

    python benchmarks/capacity.py --json docs/results/capacity.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from splash_rollout import EngineConfig  # noqa: E402
from splash_rollout.distributed.launch import WorkerGroup  # noqa: E402
from splash_rollout.engine.rank_engine import pages_per_rank, sizes_for  # noqa: E402
from splash_rollout.scheduling.admission import AdmissionSettings  # noqa: E402
from splash_rollout.engine.placement import KVPlacement  # noqa: E402
from splash_rollout.engine.request import Request, SamplingSpec  # noqa: E402
from splash_rollout.engine.request_scheduler import Scheduler  # noqa: E402
from splash_rollout.layout.footprint import RankBudget, footprints  # noqa: E402
from splash_rollout.layout.layouts import ALL_LAYOUTS, Layout  # noqa: E402
from splash_rollout.models.config import resolve_model  # noqa: E402
from splash_rollout.rollout.build import TORCH_DTYPES, build_engine  # noqa: E402

SYSTEMS = tuple(l.value for l in ALL_LAYOUTS) + ("auto",)


def make_requests(num: int, prompt_len: int, max_new: int, vocab_size: int, max_len: int) -> list[Request]:
    g = torch.Generator().manual_seed(0)
    return [Request(i, torch.randint(2, vocab_size, (prompt_len,), generator=g).tolist(),
                    SamplingSpec(temperature=0.0, max_new_tokens=max_new, ignore_eos=True, seed=i), max_len)
            for i in range(num)]


def predicted_concurrency(layout: Layout, pages: int, world_size: int, page_size: int, requests: list[Request]) -> int:
    """Requests admitted at once into empty pools when each holds its whole cap (worst-case admission)."""
    placement = KVPlacement([pages] * world_size, page_size, layout)
    scheduler = Scheduler(placement, 10**9, 10**9, admission=AdmissionSettings(mode="worst_case"), prefix_sharing=False)
    for r in requests:
        scheduler.add(r)
    scheduler.schedule()
    return len(scheduler.running)


def serve_on_rank(ctx, config: EngineConfig, num: int, prompt_len: int, max_new: int) -> dict | None:
    """Every rank: build the engine as RolloutEngine does, serve the requests; rank 0 reports."""
    engine = build_engine(config, ctx.groups)
    cfg = resolve_model(config.model.source)
    reqs = make_requests(num, prompt_len, max_new, cfg.vocab_size, cfg.max_position_embeddings)  # every rank: a replica each
    start = time.perf_counter()
    finished = engine.serve(reqs)
    wall = time.perf_counter() - start
    if ctx.rank != 0:
        return None
    log = engine.step_log
    done = [s for s in engine.switch_log if s.get("deferred_reason") is None]
    return {"pool_pages_at_end": engine.state.pool.num_pages, "max_running": max(s.running for s in log),
            "steps": len(log), "wall_s": wall, "finished": len(finished),
            "tokens": sum(len(r.output_ids) for r in finished),
            "switch_path": [f"{s['src']}->{s['dst']}@{s['step']}" for s in done],
            "deferred_switches": len(engine.switch_log) - len(done),
            "layout_per_step": [s.layout for s in log]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="output JSON path")
    ap.add_argument("--model", default="glm5-nano")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--memory-budget-mib", type=float, default=2.5, help="attention weights + KV per rank")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=80)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    args = ap.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    cfg = resolve_model(args.model)
    dtype = "float32"
    budget = int(args.memory_budget_mib * 2**20)
    t = args.world_size
    fps = footprints(sizes_for(cfg, TORCH_DTYPES[dtype]), t, RankBudget(budget), args.page_size)
    probe = make_requests(args.requests, args.prompt_len, args.max_new_tokens, cfg.vocab_size, cfg.max_position_embeddings)
    rows: dict[str, dict] = {}
    with WorkerGroup(t, timeout_s=600) as group:
        for name in systems:
            config = EngineConfig(model=args.model, world_size=t, layout=name, dtype=dtype, page_size=args.page_size,
                                  memory_budget_gib=budget / 2**30, max_num_batched_tokens=512,
                                  max_num_seqs=max(256, args.requests), admission="worst_case")
            measured = group.run(serve_on_rank, config, args.requests, args.prompt_len, args.max_new_tokens,
                                 timeout_s=1800)[0]
            row: dict = {"measured": measured}
            if name != "auto":
                layout = Layout.parse(name)
                pages = pages_per_rank(cfg, layout, t, budget, args.page_size, TORCH_DTYPES[dtype])
                fp = fps[layout]
                row.update(pool_pages_per_rank=pages, pool_tokens_per_rank=pages * args.page_size,
                           distinct_tokens=fp.distinct_tokens, attention_weight_bytes_per_rank=fp.weight_bytes_per_rank,
                           predicted_max_running=predicted_concurrency(layout, pages, t, args.page_size, probe))
                if row["predicted_max_running"] != measured["max_running"]:
                    print(f"  warning: {name} ran {measured['max_running']} at once, admission predicts "
                          f"{row['predicted_max_running']}", file=sys.stderr)
            rows[name] = row
            print(f"  {name:>5}: pool {row.get('pool_tokens_per_rank', '-')} tokens/rank, "
                  f"max running {measured['max_running']}, {measured['steps']} steps, {measured['wall_s']:.1f} s",
                  file=sys.stderr)
    result = {
        "model": args.model, "world_size": t, "dtype": dtype, "page_size": args.page_size,
        "memory_budget_mib_per_rank": args.memory_budget_mib,
        "kv_bytes_per_token": fps[Layout.TP].kv_bytes_per_token,
        "workload": {"requests": args.requests, "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens,
                     "tokens_per_request": args.prompt_len + args.max_new_tokens},
        "max_running": {k: v["measured"]["max_running"] for k, v in rows.items()},
        "pool_tokens_per_rank": {k: v["pool_tokens_per_rank"] for k, v in rows.items() if "pool_tokens_per_rank" in v},
        "steps": {k: v["measured"]["steps"] for k, v in rows.items()},
        "layouts": rows,
    }
    if {"dop", "dp"} <= set(result["max_running"]):
        result["dop_vs_dp_admitted"] = result["max_running"]["dop"] / result["max_running"]["dp"]
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("pool_tokens_per_rank", "max_running", "steps")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
