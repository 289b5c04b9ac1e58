"""Speculative decoding on RL rollouts: the same calls with ``speculation`` off and on, side by side.

The policy is the default recipe's after its SFT warm start and its 24 GRPO steps on one rank (trained
here once, ~7 minutes; ``--policy P`` reuses a ``policy.pt`` or ``sft_policy.pt``): drafts are only as good as the text the
policy writes, and a random-init model writes noise. Two workloads on one engine rank:

* ``long_tail``: the ``benchmarks/long_tail_rl.py`` rollout -- arithmetic chains whose length
  follows a power law up to 32 steps, ``prompts`` x ``n`` samples, temperature 1, a 224-token
  budget -- where a step starts wide and ends with a few long samples;
* ``wide``: ``wide_prompts`` prompts x 1 sample of 16 tokens, nothing but a wide batch: all of them
  at once, a lockstep batch that ends when its slowest sample has its 16 tokens;
* ``wide_queued``: 4 x ``wide_prompts`` prompts x 1 sample of 16 tokens through ``wide_prompts``
  running slots (``max_num_seqs``): the queue refills the batch as samples finish, like an RL
  step's wide phase, so throughput is what the call's time measures.

Arms ``speculation[:draft]`` (``off``; ``always`` or ``auto``, the cost-model gate; drafts from
``ngram``, the n-gram drafter, or ``mtp``, the policy's own MTP module) alternate call by call on
engines built once, ``--rounds`` each;
every call gets fresh prompts (the same for both arms in a round), so the prompt history the
drafter keeps across calls is what a GRPO run on fresh prompts would have. Per call: wall seconds,
the tail's seconds (steps run with the batch at or below 1/8 of the call's peak; the step log's
times), engine steps (target forward passes) per generated token, and the ``spec/*`` metrics --
per draft source too (the group's samples, earlier calls' responses, the sample's own text, its
prompt: where each draft's first token was last seen; the MTP module), and the share of drafts kept
at each drafted position (median over calls).
Tokens are checked equal between the arms (the same seeds: speculation must not change them).

    python benchmarks/speculative.py --json docs/results/speculative.json
    python benchmarks/speculative.py --quick --json /tmp/spec_quick.json   # smoke run, ~2 min
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from splash_rollout.rollout.types import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FULL = dict(sft_steps=300, grpo_steps=24, grpo_batch=None, prompts=8, n=8, max_new_tokens=224, max_chain=32, wide_prompts=64,
            rounds=3)
QUICK = dict(sft_steps=20, grpo_steps=1, grpo_batch=(8, 8), prompts=4, n=4, max_new_tokens=48, max_chain=32, wide_prompts=16, rounds=2)
TAIL_FRACTION = 0.125


def train_policy(p: dict, work: str, threads: int) -> str:
    """SFT plus ``grpo_steps`` GRPO steps of the default recipe on one rank (its whole run by default;
    ``grpo_batch``: prompts x samples per step instead of the recipe's); the last checkpoint's policy."""
    run_dir = os.path.join(work, "train")
    cmd = [sys.executable, "-m", "splash_rollout.run", "+recipe=grpo_glm5", "logger=none", "engine.parallel.world_size=1",
           f"hardware.threads={threads}", f"sft.steps={p['sft_steps']}", f"grpo.steps={p['grpo_steps']}",
           f"trainer.save_every={p['grpo_steps']}", "eval.every=0", f"hydra.run.dir={run_dir}"]
    if p["grpo_batch"]:
        cmd += [f"grpo.prompts_per_step={p['grpo_batch'][0]}", f"grpo.n={p['grpo_batch'][1]}"]
    print(f"training the policy: {' '.join(cmd[2:])}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"training failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return os.path.join(run_dir, "checkpoints", f"step_{p['grpo_steps']:06d}", "policy.pt")  # after that many steps


def tail_seconds(timeline: dict, fraction: float = TAIL_FRACTION) -> float:
    """Seconds of the call spent with the running batch at or below ``fraction`` of its peak (from
    the layout timeline's batch curve: (seconds since the call began, running requests) per step)."""
    curve = [point for phase in timeline["phases"] for point in phase["batch_curve"]]
    peak = max((b for _, b in curve), default=0)
    return float(sum(t1 - t0 for (t0, b0), (t1, _) in zip(curve, curve[1:]) if b0 <= fraction * peak))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--policy", help="a policy.pt / sft_policy.pt to load instead of training one")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--arms", default="off,auto:ngram,always:mtp,auto:mtp",
                    help="comma-separated speculation[:draft] (draft: ngram, mtp, auto); off is the reference")
    ap.add_argument("--workloads", default="long_tail,wide,wide_queued", help="comma-separated subset")
    ap.add_argument("--numerics", default="reproducible", choices=("reproducible", "fast"),
                    help="the engine's numerics (the recipe's default: reproducible)")
    args = ap.parse_args()
    if args.arms.split(",")[0] != "off":
        ap.error("--arms: the first arm must be off (the reference the others are checked against)")
    return args


def build_arms(args, p: dict, weights) -> tuple[dict, list[list[int]], tuple[int, ...]]:
    """One engine per arm (the recipe's, one rank, TP) holding ``weights``; the prompts every round
    draws from; the stop tokens."""
    from splash_rollout.recipes.grpo.build import build_engine, data_options, max_prompt_len
    from splash_rollout.recipes.grpo.task_data import build_task_data
    from splash_rollout.models.tokenizer import load_tokenizer
    from splash_rollout.run import compose_config

    overrides = ["+recipe=grpo_glm5", "engine.parallel.world_size=1", f"engine.compute.numerics={args.numerics}",
                 f"engine.batching.max_num_seqs={max(p['wide_prompts'], p['prompts'] * p['n'])}",
                 "engine.memory.memory_budget_gib=0.25", "engine.parallel.layout=tp",
                 f"data.task.max_steps={p['max_chain']}", f"grpo.max_new_tokens={p['max_new_tokens']}", "eval.every=0"]
    calls = p["rounds"] * (p["prompts"] + 5 * p["wide_prompts"])
    cfg = compose_config(overrides + [f"data.eval_size=0", f"data.seed=1234"])
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.name)
    data = build_task_data(data_options(cfg), tokenizer, max_prompt_len(cfg), need_eval=False, fresh_prompts=calls)
    engines = {}
    for arm in args.arms.split(","):
        speculation, _, draft = arm.partition(":")
        engines[arm] = build_engine(compose_config(overrides + [f"engine.compute.speculation={speculation}"]
                                                   + ([f"engine.compute.draft={draft}"] if draft else [])))
        engines[arm].update_weights(weights, version=1)
    return engines, [e.prompt_ids for e in data.train], tuple(tokenizer.eos_token_ids)


def run_rounds(engines: dict, workloads: dict, prompts: list[list[int]], rounds: int) -> tuple[dict, list[float]]:
    """Every round, every workload's calls on every arm, alternated; each arm's tokens checked equal to
    off's. Returns the per-call records by workload and arm, and the load averages seen."""
    arms = list(engines)
    results: dict = {name: {arm: [] for arm in arms} for name in workloads}
    cursor, loads = 0, []
    for rnd in range(rounds):
        for name, (count, params) in workloads.items():
            batch_prompts = prompts[cursor: cursor + count]
            cursor += count
            tokens = {}
            for arm in arms:
                params_r = SamplingParams(**{**params.__dict__, "seed": 1000 + rnd})
                t0 = time.perf_counter()
                batch = engines[arm].generate(batch_prompts, params_r)
                wall = time.perf_counter() - t0
                steps = int(batch.metrics["perf/steps"])
                generated = sum(len(s.response_ids) for s in batch.samples)
                tokens[arm] = [s.response_ids for s in batch.samples]
                results[name][arm].append({
                    "wall_s": wall, "tail_s": tail_seconds(batch.timeline.to_dict()), "generated": generated,
                    "tokens_per_s": generated / wall, "steps": steps, "forward_passes_per_token": steps / max(1, generated),
                    **{k: v for k, v in batch.metrics.items() if k.startswith("spec/")}})
                loads.append(os.getloadavg()[0])
                r = results[name][arm][-1]
                print(f"round {rnd} {name:9s} {arm:12s} {wall:7.2f} s (tail {r['tail_s']:.2f} s) "
                      f"{r['tokens_per_s']:7.1f} tok/s, {r['steps']} steps, "
                      f"acceptance_len {r.get('spec/acceptance_len', 0):.2f}", flush=True)
            for arm in arms[1:]:
                if tokens[arm] != tokens["off"]:
                    raise SystemExit(f"round {rnd} {name}: speculation {arm} changed the tokens")
    return results, loads


def _median(rows, key) -> float:
    return float(np.median([r[key] for r in rows]))


def _by_source(rows) -> dict:
    """Per draft source: verified drafts and tokens a verified row yielded, over the rounds."""
    from splash_rollout.engine.drafter import DRAFT_SOURCES

    out = {}
    for src in DRAFT_SOURCES:
        v = sum(r[f"spec/verified/{src}"] for r in rows)
        kept = sum(r[f"spec/acceptance_len/{src}"] * r[f"spec/verified/{src}"] for r in rows)
        out[src] = {"verified": v, "acceptance_len": kept / v if v else 0.0}
    return out


def summarize(results: dict) -> dict:
    """Per workload: each arm's median wall, tail and passes per token; per arm against off, the
    ratios, acceptance, the share of steps that drafted, acceptance by position and by source."""
    summary = {}
    for name, by_arm in results.items():
        off = by_arm["off"]
        summary[name] = {"median_wall_s": {a: _median(r, "wall_s") for a, r in by_arm.items()},
                         "median_tail_s": {a: _median(r, "tail_s") for a, r in by_arm.items()},
                         "forward_passes_per_token": {a: _median(r, "forward_passes_per_token")
                                                      for a, r in by_arm.items()}}
        for arm, on in list(by_arm.items())[1:]:
            summary[name][arm] = {
                "wall_ratio_off_over_arm": _median(off, "wall_s") / _median(on, "wall_s"),
                "tail_ratio_off_over_arm": _median(off, "tail_s") / max(_median(on, "tail_s"), 1e-9),
                "acceptance_len": _median(on, "spec/acceptance_len"),
                "accepted_per_drafted": (sum(r["spec/accepted_tokens"] for r in on)
                                         / max(1.0, sum(r["spec/draft_tokens"] for r in on))),
                "steps_on_share": sum(r["spec/steps_on"] for r in on) / max(1, sum(r["steps"] for r in on)),
                "accepted_at": {j: _median([r for r in on if f"spec/accepted_at/{j}" in r], f"spec/accepted_at/{j}")
                                for j in range(1, 9) if any(f"spec/accepted_at/{j}" in r for r in on)},
                "by_source": _by_source(on)}
    return summary


def main() -> int:
    args = parse_args()
    p = dict(QUICK if args.quick else FULL)
    if args.rounds:
        p["rounds"] = args.rounds
    import torch

    torch.set_num_threads(args.threads)
    work = tempfile.mkdtemp(prefix="spec_bench_")
    policy_path = args.policy or train_policy(p, work, args.threads)
    engines, prompts, stop = build_arms(args, p, torch.load(policy_path, map_location="cpu"))
    workloads = {
        "long_tail": (p["prompts"], SamplingParams(n=p["n"], temperature=1.0, max_new_tokens=p["max_new_tokens"],
                                                   stop_token_ids=stop)),
        "wide": (p["wide_prompts"], SamplingParams(n=1, temperature=1.0, max_new_tokens=16, stop_token_ids=stop,
                                                   ignore_eos=True)),
        "wide_queued": (4 * p["wide_prompts"], SamplingParams(n=1, temperature=1.0, max_new_tokens=16,
                                                              stop_token_ids=stop, ignore_eos=True))}
    workloads = {name: workloads[name] for name in args.workloads.split(",")}
    results, loads = run_rounds(engines, workloads, prompts, p["rounds"])
    summary = summarize(results)
    out = {"params": p, "policy": policy_path, "threads": args.threads, "numerics": args.numerics,
           "load_1min": [min(loads), max(loads)], "tokens_equal": True, "summary": summary, "rounds": results,
           "command": "python benchmarks/speculative.py" + (" --quick" if args.quick else "")}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(summary, indent=1))
    for eng in engines.values():
        eng.shutdown()
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
