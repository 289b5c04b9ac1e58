"""Load test: thousands of short prompts in ONE generate call on 2 spawned ranks.

Workload: ``--num-prompts`` (2,000) prompts of 4-32 random tokens, ``n`` (4) samples each, up to
``--max-new-tokens`` (8) sampled tokens with temperature 1 and a few stop tokens, on ``glm5-nano``
(random init, float32, CPU), ``world_size`` 2, layout ``dp`` (or ``auto``). Checks that every one of
the num_prompts x n samples comes back exactly once, in its group, with a finish reason, and that
no KV page is left held; reports the wall time and the peak RSS (``getrusage`` maxrss) of the caller
and of each rank, before and after the call, so growth with the number of requests shows.

    python benchmarks/load_test.py --json OUT.json [--num-prompts 2000 --n 4 --layout dp]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams  # noqa: E402


def peak_rss_mib(ctx=None) -> float:
    """This process's peak resident set (Linux reports ru_maxrss in KiB). Also run on each rank."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def held_pages(ctx) -> dict | None:
    """Rank 0: pages in use and page references per rank in the driver's page tables (both must be 0)."""
    if ctx.rank:
        return None
    placement = ctx.state["engine"].scheduler.placement
    return {"used": placement.pages_in_use, "references": [m.num_references for m in placement.managers]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="output JSON path")
    ap.add_argument("--num-prompts", type=int, default=2000)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--layout", default="dp")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(2, 512, int(k)).tolist() for k in rng.integers(4, 33, args.num_prompts)]
    stops = tuple(int(t) for t in rng.choice(np.arange(2, 512), 8, replace=False))
    sampling = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, stop_token_ids=stops)
    config = EngineConfig(model="glm5-nano", world_size=args.world_size, layout=args.layout, seed=args.seed,
                          page_size=16, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens)
    with RolloutEngine(config) as engine:
        before = {"caller": peak_rss_mib(), "ranks": engine.worker_group.run(peak_rss_mib)}
        start = time.perf_counter()
        batch = engine.generate(prompts, sampling)
        wall = time.perf_counter() - start
        after = {"caller": peak_rss_mib(), "ranks": engine.worker_group.run(peak_rss_mib)}
        pages = engine.worker_group.run(held_pages)[0]

    samples = batch.samples
    reasons = collections.Counter(s.finish_reason for s in samples)
    problems = []
    if len(samples) != args.num_prompts * args.n:
        problems.append(f"{len(samples)} samples, expected {args.num_prompts * args.n}")
    if [g.prompt_index for g in batch.groups] != list(range(args.num_prompts)):
        problems.append("groups out of order or missing")
    for g in batch.groups:
        if len(g.samples) != args.n or any(s.prompt_ids != prompts[g.prompt_index] for s in g.samples):
            problems.append(f"group {g.prompt_index}: {len(g.samples)} samples or a wrong prompt")
    if set(reasons) - {"stop", "length"}:
        problems.append(f"finish reasons {dict(reasons)}")
    if any(not s.response_ids or len(s.response_ids) > args.max_new_tokens for s in samples):
        problems.append("a response is empty or longer than max_new_tokens")
    if len({s.seed for s in samples}) != len(samples):
        problems.append("two samples share a seed")
    if any(pages["used"]) or any(pages["references"]):
        problems.append(f"pages held after the call: {pages}")
    tokens = sum(len(s.response_ids) for s in samples)
    result = {
        "workload": {"num_prompts": args.num_prompts, "n": args.n, "max_new_tokens": args.max_new_tokens,
                     "prompt_tokens": sum(map(len, prompts)), "world_size": args.world_size, "layout": args.layout,
                     "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens},
        "samples": len(samples), "expected_samples": args.num_prompts * args.n,
        "finish_reasons": dict(reasons), "response_tokens": tokens, "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1), "steps": batch.metrics["perf/steps"],
        "layout_phases": [(p["layout"], p["steps"]) for p in batch.timeline.phases],
        "peak_rss_mib_before_call": before, "peak_rss_mib_after_call": after,
        "pages_held_after_call": pages, "ok": not problems, "problems": problems[:20],
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    if problems:
        sys.exit(1)


if __name__ == "__main__":
    main()
