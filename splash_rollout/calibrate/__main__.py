"""``python -m splash_rollout.calibrate --world-size T --out profile.yaml``: measure θ on this machine.

Two passes over T spawned ranks (gloo on CPU):

1. microbenchmarks (``probes.py``): GEMM and attention rates, memory read bandwidth, latency and
   bandwidth of each collective -- the slowest rank's numbers;
2. the engine itself (``bench.layouts``): prefill and decode steps of every layout over a grid of
   batch sizes and contexts, to which ``scheduling.fit`` fits the cost model's constants (rates as
   the engine's kernels reach them, per-request, per-expert and elementwise costs, collective
   latency and bandwidth as the engine's collectives pay them). ``--no-engine-fit`` skips it.

Writes a YAML profile that ``EngineConfig(pricing={"profile": ...})``, the scheduler and ``bench costmodel`` read,
and (``--points-json``) the measured grid with the fit's report. Use a grid other than the one you
check the model on: ``bench costmodel`` defaults to B in {1, 4, 16} x context in {64, 256, 1024}.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from splash_rollout.cli_args import positive_ints
from splash_rollout.layout.layouts import ALL_LAYOUTS
from splash_rollout.scheduling.profile import CollectiveCost, HardwareProfile, save_profile

CAL_BATCHES = (1, 3, 8, 24)
CAL_CONTEXTS = (32, 128, 512, 768)
ENGINE_OF_BACKEND = {"cpu": "cpu", "torch": "torch_ref", "torch_ref": "torch_ref"}
"""The cost model's engine kind (``HardwareProfile.engine``) that prices each attention backend."""
QUICK_BATCHES = (1, 4, 12)
QUICK_CONTEXTS = (32, 256)
"""``--quick``: a grid that runs in well under a minute, to check the command end to end (its fit is
rougher than the default grid's)."""


def _microbenchmarks(group, world_size: int, memory_gib: float) -> HardwareProfile:
    from splash_rollout.calibrate.probes import probe_rank

    ranks = group.run(probe_rank, timeout_s=600)
    slowest = {k: min(r[k] for r in ranks) for k in ("matmul_flops", "attention_flops", "read_Bps")}
    coll = {name: CollectiveCost(max(r["collectives"][name][0] for r in ranks),
                                 min(r["collectives"][name][1] for r in ranks))
            for name in ("all_gather", "all_to_all", "all_reduce")}
    return HardwareProfile(
        name=f"calibrated-cpu-T{world_size}", world_size=world_size, memory_bytes=int(memory_gib * 2**30),
        mem_fraction=1.0, matmul_flops=slowest["matmul_flops"], attention_flops=slowest["attention_flops"],
        weight_read_Bps=slowest["read_Bps"], kv_read_Bps=slowest["read_Bps"], all_gather=coll["all_gather"],
        all_to_all=coll["all_to_all"], all_reduce=coll["all_reduce"],
        step_overhead_s=max(r["step_overhead_s"] for r in ranks), layer_overhead_s=20e-6)


def measure_engine_grid(group, model: str, batches, contexts, repeats: int, attention_backend: str = "cpu",
                        log=sys.stderr) -> list[dict]:
    """Every layout's prefill / decode step times over batches x contexts on ``group``."""
    from splash_rollout.bench.layouts import bench_on_rank

    start = time.perf_counter()
    points = group.run(bench_on_rank, model, [l.value for l in ALL_LAYOUTS], list(batches), list(contexts), 16,
                       repeats, timeout_s=7200, attention_backend=attention_backend)[0]
    print(f"  engine grid: {len(points)} points in {time.perf_counter() - start:.1f} s", file=log, flush=True)
    return points


def calibrate(world_size: int, memory_gib: float, fit_engine: bool = True, model: str = "glm5-nano",
              batches=CAL_BATCHES, contexts=CAL_CONTEXTS, repeats: int = 3,
              attention_backend: str = "cpu") -> tuple[HardwareProfile, dict]:
    """(θ, report): microbenchmarks, then (``fit_engine``) the engine-grid fit on top of them."""
    from splash_rollout.distributed.launch import WorkerGroup

    with WorkerGroup(world_size, timeout_s=120) as group:
        print("microbenchmarks ...", file=sys.stderr, flush=True)
        profile = _microbenchmarks(group, world_size, memory_gib)
        if not fit_engine:
            return profile, {}
        print(f"engine grid: {model}, {attention_backend} attention, B {list(batches)} x context {list(contexts)}, "
              f"{repeats} repeats ...",
              file=sys.stderr, flush=True)
        points = measure_engine_grid(group, model, batches, contexts, repeats, attention_backend)
    return fit_measured(profile, points, model, attention_backend)


def fit_measured(profile: HardwareProfile, points: list[dict], model: str,
                 attention_backend: str = "cpu") -> tuple[HardwareProfile, dict]:
    import torch

    from splash_rollout.engine.rank_engine import sizes_for
    from splash_rollout.models.config import resolve_model
    from splash_rollout.scheduling.fit import fit_profile

    print(f"fitting {len(points)} grid points ...", file=sys.stderr, flush=True)
    cfg = resolve_model(model)
    fitted, report = fit_profile(points, cfg, sizes_for(cfg, torch.float32), profile,
                                 engine=ENGINE_OF_BACKEND[attention_backend])
    print(f"fit: median |error| {report['median_abs_error']:.1%}, max {report['max_abs_error']:.1%} "
          f"over {2 * len(points)} steps", file=sys.stderr)
    return fitted, {"model": model, "attention_backend": attention_backend, "fit": report, "points": points,
                    "microbenchmarks": profile.to_dict()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m splash_rollout.calibrate", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="ranks T to measure")
    parser.add_argument("--memory-gib", type=float, default=1.0, help="per-rank memory recorded in the profile")
    parser.add_argument("--out", default="profile.yaml", help="YAML profile path")
    parser.add_argument("--no-engine-fit", action="store_true", help="microbenchmarks only (seconds, not minutes)")
    parser.add_argument("--model", default="glm5-nano", help="model the engine grid runs")
    parser.add_argument("--attention-backend", choices=sorted(ENGINE_OF_BACKEND), default="cpu",
                        help="the backend the engine grid runs (default cpu, the engine's own default); the profile "
                             "prices that engine")
    parser.add_argument("--quick", action="store_true",
                        help=f"a small engine grid (B {list(QUICK_BATCHES)} x context {list(QUICK_CONTEXTS)}, "
                             f"1 repeat) that checks the command end to end")
    parser.add_argument("--batches", type=positive_ints, default=None,
                        help=f"engine grid batch sizes (default {','.join(map(str, CAL_BATCHES))})")
    parser.add_argument("--contexts", type=positive_ints, default=None,
                        help=f"engine grid prompt lengths (default {','.join(map(str, CAL_CONTEXTS))})")
    parser.add_argument("--repeats", type=int, default=None, help="fresh batches per grid point (median; default 3)")
    parser.add_argument("--measured", help="fit a grid measured before (its --points-json) instead of measuring")
    parser.add_argument("--points-json", help="write the measured grid and the fit report here")
    args = parser.parse_args(argv)
    if args.world_size < 1:
        print(f"{parser.prog}: error: --world-size: expected a positive integer, got {args.world_size}",
              file=sys.stderr)
        return 2
    batches = args.batches or list(QUICK_BATCHES if args.quick else CAL_BATCHES)
    contexts = args.contexts or list(QUICK_CONTEXTS if args.quick else CAL_CONTEXTS)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    if repeats < 1:
        print(f"{parser.prog}: error: --repeats: expected a positive integer, got {repeats}", file=sys.stderr)
        return 2
    if args.measured:
        with open(args.measured) as f:
            saved = json.load(f)
        base = HardwareProfile.from_dict(saved["microbenchmarks"], source=args.measured)
        # grids saved before the cpu backend existed were measured with the batched torch backend
        profile, report = fit_measured(base, saved["points"], saved.get("model", args.model),
                                       saved.get("attention_backend", "torch"))
    else:
        profile, report = calibrate(args.world_size, args.memory_gib, not args.no_engine_fit, args.model,
                                    batches, contexts, repeats, args.attention_backend)
    save_profile(profile, args.out)
    if args.points_json and report:
        with open(args.points_json, "w") as f:
            json.dump(report, f, indent=2)
    for k, v in profile.to_dict().items():
        print(f"{k:>18}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
