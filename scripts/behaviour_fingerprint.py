"""What a refactor must not change: tokens, layout decisions and GRPO metrics, as one JSON.

Run it before and after a change that should not change behaviour, and compare the two files:

    python scripts/behaviour_fingerprint.py --out before.json     # on the old commit
    python scripts/behaviour_fingerprint.py --out after.json      # on the new one
    python scripts/behaviour_fingerprint.py --compare before.json after.json

Three workloads, all deterministic (no wall-clock input reaches a decision):

* **the memory-bound drain**: glm5-nano on 2 ranks, ``layout="auto"``, a 2.5 MiB budget per rank
  so that the pools bind, worst-case admission, the online correction off and speculation
  ``always`` (measured step times, and ``auto``'s measured tokens per second of drafted and plain
  runs, would make decisions follow the machine's load: a step that drafted elsewhere meets the
  next decision with another batch). Recorded: every sample's tokens and logprobs,
  every policy decision (step, rule, chosen layout, admissions, predicted costs) and every switch.
* **the simulator's adaptive drains** (GPU-scale, the same policy code with optimistic admission
  and pressure relief): switch paths, switches and simulated tokens/s of three named workloads;
* **a short GRPO run** of the default recipe under ``engine.compute.numerics=reproducible`` (2 SFT steps,
  2 GRPO steps of 4 prompts x 4 samples, online correction off, speculation ``always``): every metrics.jsonl row with its
  wall-clock fields (times, rates, policy seconds) dropped.

About 2 minutes on 2 cores. ``--compare`` names the first difference in each section.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

SWITCH_TIMES = ("overhead_ms", "blocking_estimate_ms", "step_seconds")
"""Switch-record fields that measure the machine, not the behaviour."""


def _rounded(x, digits: int = 9):
    """Floats to 9 significant digits (JSON round trips), inf and nan as strings."""
    if isinstance(x, float):
        return str(x) if not math.isfinite(x) else float(f"{x:.{digits}g}")
    if isinstance(x, dict):
        return {k: _rounded(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v, digits) for v in x]
    return x


def drain() -> dict:
    from splash_rollout import EngineConfig, RolloutEngine, SamplingParams

    prompts = [[5 + i % 50] * (16 + (7 * i) % 24) for i in range(24)] + [[9] * 60, [11] * 50]
    params = ([SamplingParams(temperature=0, max_new_tokens=8 + (5 * i) % 16, ignore_eos=True) for i in range(12)]
              + [SamplingParams(temperature=1.0, top_k=20, max_new_tokens=8 + (5 * i) % 16, ignore_eos=True, seed=i)
                 for i in range(12, 24)]
              + [SamplingParams(temperature=0, max_new_tokens=160, ignore_eos=True)] * 2)
    cfg = EngineConfig(model="glm5-nano", world_size=2, layout="auto", page_size=16, max_num_batched_tokens=512,
                       memory_budget_gib=2.5 / 1024, admission="worst_case", online_correction=False,
                       speculation="always")
    with RolloutEngine(cfg) as engine:
        batch = engine.generate(prompts, params)
    timeline = batch.timeline.to_dict()
    keep = ("step", "current", "chosen", "switch", "rule", "admitted", "step_costs", "seconds_per_token",
            "switch_cost_s", "horizon_steps", "cause", "reason")
    return _rounded({
        "tokens": [s.response_ids for s in batch.samples],
        "logprobs": [[float(x) for x in s.response_logprobs] for s in batch.samples],
        "decisions": [{k: d.get(k) for k in keep if k in d} for d in timeline["decisions"]],
        "switches": [{k: v for k, v in s.items() if k not in SWITCH_TIMES} for s in timeline.get("switches", [])],
    })


def simulated() -> dict:
    """The GPU-scale simulator's adaptive drains (its policy calls run the same code as the engine's,
    with optimistic admission and so pressure relief): the switch path and simulated seconds."""
    from splash_rollout.scheduling import Deployment
    from splash_rollout.sim.core import SimConfig
    from splash_rollout.sim.runs import drain as sim_drain, named_workload

    out = {}
    for hardware, workload in (("h200", "rl"), ("b200", "oscillating"), ("h200-paper", "paper")):
        dep = Deployment.build("glm-5", hardware)
        r = sim_drain(dep, named_workload(workload), SimConfig())
        out[f"{hardware}/{workload}"] = _rounded({k: r[k] for k in ("switch_path", "switches", "tokens_per_s")})
    return out


def grpo(workdir: str) -> list[dict]:
    run_dir = os.path.join(workdir, "grpo")
    cmd = [sys.executable, "-m", "splash_rollout.run", "+recipe=grpo_glm5", "engine.compute.numerics=reproducible",
           "engine.pricing.online_correction=false", "engine.compute.speculation=always", "sft.steps=2", "sft.batch_size=8", "sft.save=false", "grpo.steps=2",
           "grpo.prompts_per_step=4", "grpo.n=4", "grpo.max_new_tokens=24", "eval.every=0", "data.eval_size=8",
           "eval.max_new_tokens=24", "logger=none", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"the GRPO run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    from splash_rollout.recipes.grpo.metrics import is_wall_clock

    return [_rounded({k: v for k, v in row.items() if not is_wall_clock(k)}) for row in rows]


def first_difference(a, b, path: str = "") -> str | None:
    if type(a) is not type(b):
        return f"{path or '/'}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"{path}/{k}: only in {'after' if k not in a else 'before'}"
            d = first_difference(a[k], b[k], f"{path}/{k}")
            if d:
                return d
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if a == b else f"{path}: {a!r} vs {b!r}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the fingerprint here")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two fingerprints")
    ap.add_argument("--only", choices=("drain", "sim", "grpo"), help="one workload only")
    args = ap.parse_args()
    if args.compare:
        before, after = (json.load(open(p)) for p in args.compare)
        same = True
        for section in sorted(set(before) | set(after)):
            d = first_difference(before.get(section), after.get(section), section)
            print(f"{section}: {'identical' if d is None else 'DIFFERENT at ' + d}")
            same &= d is None
        return 0 if same else 1
    if not args.out:
        ap.error("give --out FILE or --compare BEFORE AFTER")
    out = {}
    if args.only in (None, "drain"):
        out["drain"] = drain()
        print(f"drain: {len(out['drain']['tokens'])} samples, {len(out['drain']['decisions'])} decisions, "
              f"{len(out['drain']['switches'])} switches", flush=True)
    if args.only in (None, "sim"):
        out["simulated"] = simulated()
        paths = [f"{name}: {r['switch_path']}" for name, r in out["simulated"].items()]
        print("simulated: " + "; ".join(paths), flush=True)
    if args.only in (None, "grpo"):
        with tempfile.TemporaryDirectory() as tmp:
            out["grpo_metrics"] = grpo(tmp)
        print(f"grpo: {len(out['grpo_metrics'])} metrics rows", flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
