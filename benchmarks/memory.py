"""KV memory as a production engine spends it: prompt sharing, optimistic admission, the layout as a lever.

Three side-by-side comparisons, each in one invocation (the ratios come from the same machine state),
on ``glm5-nano`` (seeded random init, float32), sampling at temperature 1 with per-sample seeds:

* ``sharing`` -- a GRPO-shaped rollout (``--prompts`` prompts of 256-512 tokens, n = 8) on one rank
  with prompt sharing on and off (the same pool, optimistic admission in both): rollout tokens/s
  and the peak KV pages any one group holds at once (distinct pages over its samples' tables).
* ``admission`` -- a heavy-tailed drain (most prompts short, a few long, n = 4) under a tight pool,
  optimistic admission vs worst-case reservation: mean running batch and tokens/s.
* ``layouts`` -- a memory-bound draining rollout on 2 spawned ranks under a per-rank budget where
  DP-attention's pool binds: every fixed layout and ``auto`` (which may switch to relieve memory
  pressure), tokens/s and the ratios auto / best fixed and auto / DP-attention.

Responses are heavy-tailed without the engine knowing their lengths: every sample's cap is
``--max-new-tokens``, and it stops when it samples one of its prompt's stop tokens. A prompt gets
``k`` stop tokens of the 512-token vocabulary, ``k = 512 / L`` with L log-normal (median
``--median-response``), so its samples' lengths are geometric with mean about L: a few prompts run
to the cap, most stop early -- what admission has to guess at. Lengths therefore differ a little
between runs whose float32 rounding differs (batching); tokens/s counts what each run produced.

    python benchmarks/memory.py --json docs/results/memory.json
    python benchmarks/memory.py --json /tmp/memory.json --quick        # smoke test, about a minute
    python benchmarks/memory.py --json /tmp/m.json --parts layouts     # one comparison
    python benchmarks/memory.py --json /tmp/m.json --parts layouts --budget-mib 3 --max-new-tokens 128 --rounds 3
    python benchmarks/memory.py --json /tmp/m.json --parts sharing --prompts 16  # a quarter of the size
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams  # noqa: E402
from splash_rollout.engine.options import EngineSettings  # noqa: E402
from splash_rollout.engine.rank_engine import Engine  # noqa: E402
from splash_rollout.rollout.build import engine_settings  # noqa: E402
from splash_rollout.rollout.config import EngineConfig  # noqa: E402
from splash_rollout.engine.request import Request, SamplingSpec  # noqa: E402
from splash_rollout.models.config import PRESETS  # noqa: E402
from splash_rollout.models.model import MLAForCausalLM  # noqa: E402

MODEL = "glm5-nano"
PARTS = ("sharing", "admission", "layouts")
FULL = {
    "sharing": dict(prompts=64, n=8, prompt_len=(256, 512), pool_tokens=65536),
    "admission": dict(prompts=64, n=4, short=(16, 128), long=(384, 768), long_fraction=0.125, pool_tokens=12288),
    "layouts": dict(prompts=48, n=4, short=(16, 96), long=(256, 384), long_fraction=0.125, budget_gib=4.0 / 1024),
}
QUICK = {
    "sharing": dict(prompts=4, n=8, prompt_len=(256, 320), pool_tokens=4096),
    "admission": dict(prompts=12, n=2, short=(16, 48), long=(96, 128), long_fraction=0.2, pool_tokens=1536),
    "layouts": dict(prompts=8, n=2, short=(16, 48), long=(96, 128), long_fraction=0.25, budget_gib=2.5 / 1024),
}
PAGE_SIZE = 16


# ---- workload ---------------------------------------------------------------------------------
def stop_sets(num_prompts: int, median_response: float, sigma: float, vocab: int, rng) -> list[tuple[int, ...]]:
    """Per prompt: the stop tokens whose count sets its samples' mean length (about vocab / k)."""
    mean_len = np.clip(rng.lognormal(np.log(median_response), sigma, num_prompts), 2.0, vocab)
    ks = np.maximum(1, np.rint(vocab / mean_len)).astype(int)
    return [tuple(int(t) for t in rng.choice(np.arange(2, vocab), k, replace=False)) for k in ks]


def prompt_lengths(p: dict, rng) -> np.ndarray:
    if "prompt_len" in p:
        return rng.integers(p["prompt_len"][0], p["prompt_len"][1] + 1, p["prompts"])
    is_long = np.zeros(p["prompts"], bool)
    is_long[rng.choice(p["prompts"], max(1, round(p["long_fraction"] * p["prompts"])), replace=False)] = True
    return np.where(is_long, rng.integers(p["long"][0], p["long"][1] + 1, p["prompts"]),
                    rng.integers(p["short"][0], p["short"][1] + 1, p["prompts"]))


def workload(p: dict, args, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    vocab = PRESETS[MODEL].vocab_size
    lens = prompt_lengths(p, rng)
    prompts = [rng.integers(2, vocab, int(k)).tolist() for k in lens]
    return {"prompts": prompts, "stops": stop_sets(len(prompts), args.median_response, args.sigma, vocab, rng),
            "n": p["n"], "max_new_tokens": args.max_new_tokens}


def engine_requests(work: dict, seed: int) -> list[Request]:
    cfg = PRESETS[MODEL]
    reqs = []
    for i, (prompt, stops) in enumerate(zip(work["prompts"], work["stops"])):
        for j in range(work["n"]):
            spec = SamplingSpec(temperature=1.0, max_new_tokens=work["max_new_tokens"], stop_token_ids=stops,
                                ignore_eos=True, seed=seed * 1_000_003 + i * 64 + j)
            reqs.append(Request(len(reqs), prompt, spec, cfg.max_position_embeddings))
    return reqs


def describe(work: dict) -> dict:
    p = [len(x) for x in work["prompts"]]
    return {"prompts": len(p), "n": work["n"], "samples": len(p) * work["n"], "max_new_tokens": work["max_new_tokens"],
            "prompt_len": {"min": min(p), "mean": float(np.mean(p)), "max": max(p)},
            "stop_tokens_per_prompt": {"min": min(map(len, work["stops"])), "max": max(map(len, work["stops"]))}}


def lengths(outputs: list[int]) -> dict:
    return {"median": float(np.median(outputs)), "mean": float(np.mean(outputs)), "p90": float(np.percentile(outputs, 90)),
            "max": int(max(outputs)), "total": int(sum(outputs))}


# ---- one rank: the engine driven directly, so each step's page tables can be read --------------
def run_single(work: dict, settings: EngineSettings, seed: int) -> dict:
    cfg = PRESETS[MODEL]
    torch.manual_seed(0)
    engine = Engine.single(MLAForCausalLM.from_config(cfg, seed=seed).eval(), cfg, settings)
    engine.serve(engine_requests({**work, "prompts": [work["prompts"][0][:8]], "stops": [()], "n": 1,
                                  "max_new_tokens": 2}, seed))  # warm-up
    engine.step_log.clear()
    peak_group: dict[tuple, int] = {}
    """prompt -> the most distinct KV pages its group held at once."""

    def group_pages(_event) -> None:
        pages: dict[tuple, set] = {}
        for r in engine.scheduler.running:
            pages.setdefault(r.prefix_key, set()).update(p for p in r.rank_pages[0] if p >= 0)
        for key, held in pages.items():
            peak_group[key] = max(peak_group.get(key, 0), len(held))

    reqs = engine_requests(work, seed)
    start = time.perf_counter()
    finished = engine.serve(reqs, on_step=group_pages)
    wall = time.perf_counter() - start
    log = engine.step_log
    out = [len(r.output_ids) for r in finished]
    manager = engine.scheduler.placement.managers[0]
    if len(finished) != len(reqs) or manager.num_used or manager.num_references:
        raise RuntimeError("a run lost a sample or left pages behind")
    lens_by_group: dict[tuple, list[int]] = {}
    for r in finished:
        lens_by_group.setdefault(r.prefix_key, []).append(len(r.output_ids))
    return {"wall_s": wall, "tokens": sum(out), "tokens_per_s": sum(out) / wall, "steps": len(log),
            "mean_running": float(np.mean([s.running for s in log])), "max_running": max(s.running for s in log),
            "prefill_rows": sum(s.prefill_rows for s in log), "retractions": sum(s.retracted for s in log),
            "prefix_hit_tokens": sum(s.prefix_hit_tokens for s in log),
            "peak_pages_used": max(max(s.pages_used) for s in log), "pool_pages": settings.num_pages,
            "peak_pages_per_group": max(peak_group.values()),
            "median_group_peak_pages": float(np.median(list(peak_group.values()))),
            "group_peak_pages": [peak_group.get(tuple(p), 0) for p in work["prompts"]], "response_len": lengths(out),
            "group_full_pages": [full_group_pages(len(p), lens_by_group.get(tuple(p), []), settings.memory.page_size)
                                 for p in work["prompts"]]}


def full_group_pages(prompt_len: int, response_lens: list[int], page_size: int) -> dict[str, int]:
    """A group's KV pages if all its samples held their final lengths at once: ``shared`` with the
    prompt's full pages held once (each sample owns the rest: its copy of a partly filled last
    prompt page and its response), ``unshared`` with every sample holding its own prompt. Their ratio
    is the least any prompt sharing can reach for these lengths; long responses push it up."""
    full = prompt_len // page_size
    own = [-(-(prompt_len + r) // page_size) for r in response_lens]
    return {"shared": full + sum(o - full for o in own), "unshared": sum(own)}


def single_rank_runs(part: str, work: dict, p: dict, args, variants: dict[str, dict]) -> dict[str, dict]:
    """One engine run per variant (memory fields over the pool's) on the same workload and pool."""
    runs = {}
    for name, overrides in variants.items():
        config = EngineConfig(model=PRESETS[MODEL], compute=dict(speculation="off"),
                              memory=dict(num_pages=p["pool_tokens"] // PAGE_SIZE, page_size=PAGE_SIZE, **overrides),
                              batching=dict(max_num_batched_tokens=args.max_num_batched_tokens,
                                            max_num_seqs=args.max_num_seqs))
        settings = engine_settings(config)
        r = runs[name] = run_single(work, settings, args.seed)
        print(f"  {part}/{name}: {r['tokens_per_s']:.1f} tok/s, mean running {r['mean_running']:.1f}, "
              f"retractions {r['retractions']}, peak pages per group {r['peak_pages_per_group']}", file=sys.stderr)
    return runs


def part_sharing(p: dict, args) -> dict:
    work = workload(p, args, args.seed)
    runs = single_rank_runs("sharing", work, p, args, {"shared": {"prefix_sharing": True},
                                                      "unshared": {"prefix_sharing": False}})
    s, u = runs["shared"], runs["unshared"]
    return {"workload": describe(work), "runs": runs,
            "ratio_tokens_per_s": s["tokens_per_s"] / u["tokens_per_s"],
            "ratio_peak_pages_per_group": s["peak_pages_per_group"] / u["peak_pages_per_group"],
            "ratio_median_group_peak_pages": s["median_group_peak_pages"] / u["median_group_peak_pages"],
            "ratio_group_peak_pages_per_group": [a / b for a, b in zip(s["group_peak_pages"], u["group_peak_pages"]) if b],
            "full_group_bound": full_group_bound(s["group_full_pages"]),
            "targets": {"ratio_tokens_per_s": ">= 2", "ratio_peak_pages_per_group": "<= 0.25"}}


def full_group_bound(groups: list[dict[str, int]]) -> dict:
    """Shared / unshared full-group pages (``full_group_pages``) over the groups: the floor the
    measured peak ratios are to be read against (a peak can only sit below it because a group's
    samples finish at different steps)."""
    ratios = [g["shared"] / g["unshared"] for g in groups if g["unshared"]]
    return {"ratio_of_sums": sum(g["shared"] for g in groups) / max(sum(g["unshared"] for g in groups), 1),
            "median_group_ratio": float(np.median(ratios)), "max_group_ratio": float(max(ratios)),
            "groups_at_or_below_0.25": float(np.mean([r <= 0.25 for r in ratios]))}


def part_admission(p: dict, args) -> dict:
    work = workload(p, args, args.seed + 1)
    runs = single_rank_runs("admission", work, p, args,
                            {mode: {"admission": mode} for mode in ("optimistic", "worst_case")})
    o, w = runs["optimistic"], runs["worst_case"]
    return {"workload": describe(work), "runs": runs,
            "ratio_mean_running": o["mean_running"] / w["mean_running"],
            "ratio_tokens_per_s": o["tokens_per_s"] / w["tokens_per_s"],
            "targets": {"ratio_mean_running": ">= 2", "ratio_tokens_per_s": ">= 1.5"}}


# ---- two ranks: the public engine, one fresh spawned group per layout ------------------------------
def run_layout(layout: str, work: dict, p: dict, args) -> dict:
    config = EngineConfig(model=MODEL, world_size=2, layout=layout, seed=args.seed, page_size=PAGE_SIZE,
                          memory_budget_gib=p["budget_gib"], max_num_batched_tokens=args.max_num_batched_tokens,
                          max_num_seqs=args.max_num_seqs, max_queued_requests=10**6)
    sampling = [SamplingParams(n=work["n"], temperature=1.0, max_new_tokens=work["max_new_tokens"], stop_token_ids=s,
                               ignore_eos=True, seed=args.seed * 1_000_003 + i * 64) for i, s in enumerate(work["stops"])]
    with RolloutEngine(config) as engine:
        engine.generate([work["prompts"][0][:8]], SamplingParams(temperature=1.0, max_new_tokens=2, seed=0))  # warm-up
        start = time.perf_counter()
        out = engine.generate(work["prompts"], sampling)
        wall = time.perf_counter() - start
    got = [len(s.response_ids) for s in out.samples]
    tl, m = out.timeline, out.metrics
    done = [s for s in tl.switches if s["deferred_reason"] is None]
    return {"wall_s": wall, "tokens": sum(got), "tokens_per_s": sum(got) / wall, "steps": int(m["perf/steps"]),
            "max_running": m["perf/max_running"], "retractions": m["rollout/retractions"],
            "prefix_hit_tokens": m["rollout/prefix_hit_tokens"], "kv_used_peak": m["memory/kv_used_peak"],
            "switches": [f"{s['src']}->{s['dst']}@{s['step']} ({s['cause']})" for s in done],
            "pressure_switches": m["layout/pressure_switches"],
            "time_share": {k.split("/")[-1]: v for k, v in m.items() if k.startswith("layout/time_share/")},
            "pressure_decisions": [d["reason"] for d in tl.decisions if d.get("logged") == "pressure"][:4],
            "decisions": [{k: d.get(k) for k in ("step", "logged", "chosen", "reason", "admitted", "seconds_per_token")}
                          for d in tl.decisions if d.get("logged") != "pressure"][:8],
            "switch_decisions": [{k: d.get(k) for k in ("step", "event", "current", "chosen", "reason", "seconds_per_token")}
                                 for d in tl.decisions if d.get("logged") in ("initial", "switch")],
            "response_len": lengths(got)}


def part_layouts(p: dict, args) -> dict:
    """Every layout and auto on one workload, ``--rounds`` times (odd rounds in reverse order, so
    no system always runs first or last on a machine whose speed drifts); each system reports its
    median round, and the ratios are taken round by round between runs minutes apart."""
    work = workload(p, args, args.seed + 2)
    systems = tuple(args.layouts)
    rounds: dict[str, list[dict]] = {l: [] for l in systems}
    for r in range(args.rounds):
        for layout in (systems if r % 2 == 0 else systems[::-1]):
            run = run_layout(layout, work, p, args)
            rounds[layout].append(run)
            print(f"  layouts/{layout}: {run['tokens_per_s']:.1f} tok/s, {run['steps']} steps, retractions "
                  f"{run['retractions']:.0f}, switches {run['switches']}", file=sys.stderr)
    runs = {l: dict(sorted(got, key=lambda x: x["tokens_per_s"])[(len(got) - 1) // 2],
                    tokens_per_s_rounds=[x["tokens_per_s"] for x in got]) for l, got in rounds.items()}
    fixed = {l: r["tokens_per_s"] for l, r in runs.items() if l != "auto"}
    best = max(fixed, key=fixed.get) if fixed else None
    out = {"workload": dict(describe(work), budget_gib_per_rank=p["budget_gib"]), "runs": runs, "best_fixed": best,
           "rounds": args.rounds, "targets": {"ratio_auto_vs_best_fixed": ">= 1.15", "ratio_auto_vs_dp": ">= 1.3"}}
    for name, base in (("best_fixed", best), ("dp", "dp")):
        if "auto" in runs and base in runs:
            out[f"ratio_auto_vs_{name}"] = runs["auto"]["tokens_per_s"] / fixed[base]
            out[f"ratio_auto_vs_{name}_by_round"] = [a["tokens_per_s"] / b["tokens_per_s"]
                                                    for a, b in zip(rounds["auto"], rounds[base])]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="output JSON path")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--quick", action="store_true", help="tiny workloads (a smoke test)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=512, help="every sample's cap")
    ap.add_argument("--median-response", type=float, default=48.0, help="median of the per-prompt mean length")
    ap.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the per-prompt mean length")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2, help="torch threads in this process")
    ap.add_argument("--budget-mib", type=float, default=None,
                    help="layouts: per-rank budget for attention weights + KV in MiB (default 4; quick 2.5, the least at which every layout holds the quick prompts)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="layouts: run every system this many times, alternating the order; each reports its median round")
    ap.add_argument("--layouts", default="dp,dop,tp,cp,auto",
                    help="layouts: the systems to run (a subset of dp,dop,tp,cp,auto; the best fixed one is the best of those run)")
    ap.add_argument("--prompts", type=int, default=None,
                    help="prompts per workload instead of each part's default (pools scale with it)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds: expected a positive integer, got {args.rounds}")
    args.layouts = [x for x in args.layouts.split(",") if x]
    if not args.layouts or set(args.layouts) - {"dp", "dop", "tp", "cp", "auto"}:
        ap.error(f"--layouts: expected a subset of dp,dop,tp,cp,auto, got {','.join(args.layouts) or 'nothing'}")
    parts = [x for x in args.parts.split(",") if x]
    bad = [x for x in parts if x not in PARTS]
    if bad:
        ap.error(f"--parts: unknown {bad}; expected a subset of {list(PARTS)}")
    if args.quick:
        args.max_new_tokens = min(args.max_new_tokens, 64)
        args.median_response = min(args.median_response, 12.0)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    sizes = QUICK if args.quick else FULL
    if args.prompts is not None:  # the same shape at another size: pools and budgets scale along
        scale = {part: args.prompts / p["prompts"] for part, p in sizes.items()}
        sizes = {part: dict(p, prompts=args.prompts,
                            **({"pool_tokens": int(p["pool_tokens"] * scale[part]) // PAGE_SIZE * PAGE_SIZE}
                               if "pool_tokens" in p else {"budget_gib": p["budget_gib"]}))
                 for part, p in sizes.items()}
    if args.budget_mib is not None:
        if args.budget_mib <= 0:
            ap.error(f"--budget-mib: expected a positive number of MiB, got {args.budget_mib}")
        sizes = {**sizes, "layouts": dict(sizes["layouts"], budget_gib=args.budget_mib / 1024)}
    result = {"model": MODEL, "page_size": PAGE_SIZE, "quick": args.quick, "seed": args.seed,
              "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs}
    for part in parts:
        print(f"memory benchmark: {part}", file=sys.stderr)
        t0 = time.perf_counter()
        result[part] = {"sharing": part_sharing, "admission": part_admission, "layouts": part_layouts}[part](
            sizes[part], args)
        result[part]["seconds"] = time.perf_counter() - t0
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    summary = {p: {k: round(v, 3) for k, v in result[p].items() if k.startswith("ratio") and isinstance(v, float)}
               for p in parts}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
