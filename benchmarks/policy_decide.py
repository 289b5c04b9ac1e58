"""What one ``LayoutPolicy.decide`` costs on this CPU (rank 0's share of a step with layout="auto").

The policy of ``EngineConfig(layout="auto", world_size=2)`` on glm5-nano (the cpu preset, 0.25 GiB
per rank), decode batches of B requests with and without a queue behind them, with the online
correction (fed 256 observed steps first) and without. Reports the minimum and median of ``--repeats``
calls per case in ms (the minimum is the least disturbed by other work on the same cores).

    python benchmarks/policy_decide.py --json /tmp/decide.json
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

from splash_rollout.layout import Layout  # noqa: E402
from splash_rollout.models.config import resolve_model  # noqa: E402
from splash_rollout.rollout.config import EngineConfig  # noqa: E402
from splash_rollout.rollout.build import make_policy  # noqa: E402
from splash_rollout.scheduling.cost_model import StepBatch  # noqa: E402
from splash_rollout.scheduling.admission_plan import Waiting  # noqa: E402

CASES = ((2, 0), (128, 0), (256, 0), (64, 192))
"""(running requests, queued requests)."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--repeats", type=int, default=100)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    out = {}
    for online in (False, True):
        cfg = EngineConfig(model="glm5-nano", world_size=2, layout="auto", online_correction=online)
        pol = make_policy(cfg, resolve_model(cfg.model.source), 2, int(0.25 * 2**30), torch.float32)
        for b in (1, 8, 64, 128):  # the correction as a drain would have fed it
            step = StepBatch.make(rng.integers(20, 800, b), 1, np.arange(b) % 2)
            for _ in range(64):
                pol.observe_step(Layout.DP, step, 0.05 * (1 + 0.1 * rng.standard_normal()))
        for b, w in CASES:
            ctx = rng.integers(20, 800, b)
            batch = StepBatch.make(ctx, 1, np.arange(b) % 2)
            rem = rng.integers(1, 200, b)
            waiting = Waiting.make(rng.integers(16, 128, w), rng.integers(100, 600, w), 512, 256) if w else None
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                pol.decide(Layout.DP, batch, rem, 100, ctx + rem, waiting)
                times.append(time.perf_counter() - t0)
            key = f"B{b}_queue{w}_{'online' if online else 'prior'}"
            out[key] = {"min_ms": 1e3 * min(times), "median_ms": 1e3 * float(np.median(times))}
            print(f"{key:>28}: min {out[key]['min_ms']:.3f} ms, median {out[key]['median_ms']:.3f} ms", file=sys.stderr)
    with open(args.json, "w") as f:
        json.dump({"decide": out, "load_average": os.getloadavg(), "cpu_count": os.cpu_count()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
