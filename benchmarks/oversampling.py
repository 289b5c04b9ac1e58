"""Over-sampling with an early stop vs a plain call, side by side, on a heavy-tailed workload.

A GRPO step that trains on T groups waits for the slowest of them. Here each group's response
length is fixed in advance (``ignore_eos``, its own ``max_new_tokens``), drawn from a Pareto tail
clipped to [4, 8 x median]; the plain call generates T groups, the streaming call asks for
``oversample`` x T and stops once T are kept (``on_group`` keeps every group, or a seeded fraction
``--keep``, standing in for a reward filter). Also measured: the streaming path's own cost, a poll
per step over the same T groups with no target (every group kept, nothing cut off).

Runs alternate call by call so load from other processes hits every variant alike; times are
medians of wall-clock and of this process's CPU time (the steadier of the two on a shared
machine). Prints (and with ``--json`` writes) ``{"wall_s": {...}, "cpu_s": {...},
"speedup_per_trained_sample": {"wall", "cpu"}, "stream_overhead": {"wall", "cpu"}, ...}``.

    python benchmarks/oversampling.py --json /tmp/oversampling.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams  # noqa: E402


def lengths(num: int, median: int, seed: int) -> list[int]:
    """Heavy-tailed response lengths: Pareto(1.2) scaled to ``median``, clipped to [4, 8 x median]."""
    rng = np.random.default_rng(seed)
    raw = rng.pareto(1.2, size=num) + 1.0
    raw = raw / np.median(raw) * median
    return [int(x) for x in np.clip(np.round(raw), 4, 8 * median)]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=16, help="T: groups trained per step")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--oversample", type=float, default=1.5, help="groups asked = oversample x T")
    ap.add_argument("--keep", type=float, default=1.0, help="fraction of groups the stand-in filter keeps")
    ap.add_argument("--median", type=int, default=12)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    asked = int(round(args.oversample * args.groups))
    lens = lengths(asked, args.median, seed=0)
    prompts = [[5 + i % 50, 6, 7] for i in range(asked)]
    params = [SamplingParams(n=args.n, max_new_tokens=m, seed=100 + i, ignore_eos=True) for i, m in enumerate(lens)]
    keep = np.random.default_rng(1).random(asked) < args.keep
    times: dict[str, list[float]] = {"plain": [], "oversample": [], "stream_all": []}
    cpu: dict[str, list[float]] = {k: [] for k in times}

    def timed(kind, call):
        t0, c0 = time.perf_counter(), time.process_time()
        out = call()
        times[kind].append(time.perf_counter() - t0)
        cpu[kind].append(time.process_time() - c0)
        return out

    kept_tokens = []
    with RolloutEngine(EngineConfig(model="glm5-nano", num_pages=1024, page_size=8, max_num_batched_tokens=256,
                                    max_num_seqs=256)) as engine:
        engine.generate(prompts[:2], params[:2])  # warm-up
        for _ in range(args.reps):
            timed("plain", lambda: engine.generate(prompts[:args.groups], params[:args.groups]))
            batch = timed("oversample", lambda: engine.generate(
                prompts, params, on_group=lambda g: bool(keep[g.prompt_index]), target_groups=args.groups))
            kept_tokens.append(sum(len(s.response_ids) for s in batch.samples))
            timed("stream_all", lambda: engine.generate(prompts[:args.groups], params[:args.groups],
                                                        on_group=lambda g: True))
    wall = {k: statistics.median(v) for k, v in times.items()}
    proc = {k: statistics.median(v) for k, v in cpu.items()}
    trained = len(batch.groups) * args.n
    per_sample = lambda m: (m["plain"] / (args.groups * args.n)) / (m["oversample"] / max(trained, 1))  # noqa: E731
    out = {"wall_s": wall, "cpu_s": proc,
           "trained_samples": {"plain": args.groups * args.n, "oversample": trained},
           "speedup_per_trained_sample": {"wall": per_sample(wall), "cpu": per_sample(proc)},
           "stream_overhead": {"wall": wall["stream_all"] / wall["plain"], "cpu": proc["stream_all"] / proc["plain"]},
           "mean_trained_response_len": {"plain": float(np.mean(lens[:args.groups])),
                                         "oversample": kept_tokens[-1] / max(trained, 1)},
           "oversample_metrics": {k: v for k, v in batch.metrics.items() if k.startswith("rollout/")},
           "lengths": {"median": float(np.median(lens)), "max": max(lens), "asked_groups": asked},
           "args": vars(args), "times_s": times, "cpu_times_s": cpu}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
