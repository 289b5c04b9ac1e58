"""``python -m splash_rollout.bench layouts``: measured CPU benchmarks, JSON + PNG.

Verbs: ``layouts`` — per-layout step latency over batch x context, prefill and decode;
``switch`` — blocking, overlapped and target-ready step times of the 12 directed switches;
``costmodel`` — the ``layouts`` grid measured and priced by the cost model with a profile.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from splash_rollout.cli_args import positive_ints
from splash_rollout.layout.layouts import ALL_LAYOUTS
from splash_rollout.models.numerics import NUMERICS_MODES


def cmd_layouts(args) -> dict:
    from splash_rollout.bench.layouts import bench_on_rank
    from splash_rollout.distributed.launch import WorkerGroup

    start = time.perf_counter()
    with WorkerGroup(args.world_size, timeout_s=600) as group:
        points = group.run(bench_on_rank, args.model, list(args.layouts), args.batches, args.contexts, 16,
                           args.repeats, 0, args.numerics, timeout_s=7200)[0]
    print(f"  {len(points)} points in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    best = {}
    for kind in ("prefill_ms", "decode_ms"):
        for p in points:
            key = f"{kind[:-3]}/B{p['batch']}/S{p['context']}"
            if key not in best or p[kind] < best[key][1]:
                best[key] = (p["layout"], p[kind])
    return {"model": args.model, "world_size": args.world_size, "numerics": args.numerics, "points": points,
            "fastest": {k: v[0] for k, v in best.items()}}


def cmd_switch(args) -> dict:
    from splash_rollout.bench.switch import bench_switch_on_rank
    from splash_rollout.distributed.launch import WorkerGroup

    with WorkerGroup(args.world_size, timeout_s=600) as group:
        rows = group.run(bench_switch_on_rank, args.model, args.batch, args.context, args.runs, timeout_s=3600)[0]
    return {"model": args.model, "world_size": args.world_size, "batch": args.batch, "context": args.context,
            "runs": args.runs, "switches": rows}


def print_switch_table(out: dict) -> None:
    print(f"{out['model']}  T={out['world_size']}  B={out['batch']}  context={out['context']}  runs={out['runs']}"
          "  (ms; dT = p50(p95) over target-ready)")
    print(f"{'switch':>9} {'ready':>8} {'blocking':>9} {'dT block':>15} {'overlap':>9} {'dT overlap':>15} {'reduction':>9}")
    for r in out["switches"]:
        red = f"{100 * r['overhead_reduction']:.0f}%" if r["overhead_reduction"] is not None else "-"
        print(f"{r['src'] + '->' + r['dst']:>9} {r['ready_p50_ms']:>8.1f} {r['blocking_p50_ms']:>9.1f} "
              f"{r['blocking_overhead_p50_ms']:>7.1f}({r['blocking_overhead_p95_ms']:>5.1f}) {r['overlapped_p50_ms']:>9.1f} "
              f"{r['overlapped_overhead_p50_ms']:>7.1f}({r['overlapped_overhead_p95_ms']:>5.1f}) {red:>9}")


def plot_layouts(out: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({p["batch"] for p in out["points"]})
    fig, axes = plt.subplots(2, len(batches), figsize=(4 * len(batches), 6), squeeze=False)
    for col, b in enumerate(batches):
        for row, kind in enumerate(("prefill_ms", "decode_ms")):
            ax = axes[row][col]
            for layout in sorted({p["layout"] for p in out["points"]}):
                pts = sorted((p["context"], p[kind]) for p in out["points"] if p["batch"] == b and p["layout"] == layout)
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=layout)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{kind[:-3]} step, B={b}")
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("ms")
            ax.legend()
    fig.suptitle(f"{out['model']} on {out['world_size']} CPU ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m splash_rollout.bench", description=__doc__.splitlines()[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    lay = verbs.add_parser("layouts", help="per-layout step latency over batch x context")
    lay.add_argument("--model", default="glm5-nano")
    lay.add_argument("--world-size", type=int, default=2)
    lay.add_argument("--batches", type=positive_ints, default=[1, 4, 16])
    lay.add_argument("--contexts", type=positive_ints, default=[64, 256, 1024])
    lay.add_argument("--layouts", type=lambda t: t.split(","), default=[l.value for l in ALL_LAYOUTS])
    lay.add_argument("--repeats", type=int, default=5, help="rounds per grid point (median)")
    lay.add_argument("--numerics", choices=NUMERICS_MODES, default="fast", help="engine numerics (models/numerics.py)")
    lay.add_argument("--json", default="bench_layouts.json", help="output JSON path")
    lay.add_argument("--png", default="bench_layouts.png", help="output plot path")
    sw = verbs.add_parser("switch", help="blocking / overlapped / target-ready times of the 12 switches")
    sw.add_argument("--model", default="glm5-nano")
    sw.add_argument("--world-size", type=int, default=2)
    sw.add_argument("--batch", type=int, default=4)
    sw.add_argument("--context", type=int, default=512)
    sw.add_argument("--runs", type=int, default=20)
    sw.add_argument("--json", default="bench_switch.json", help="output JSON path")
    cm = verbs.add_parser("costmodel", help="measured vs predicted per-layout step latency")
    cm.add_argument("--profile", default="cpu", help="preset name or YAML from python -m splash_rollout.calibrate")
    cm.add_argument("--model", default="glm5-nano")
    cm.add_argument("--world-size", type=int, default=2)
    cm.add_argument("--batches", type=positive_ints, default=[1, 4, 16])
    cm.add_argument("--contexts", type=positive_ints, default=[64, 256, 1024])
    cm.add_argument("--layouts", type=lambda t: t.split(","), default=[l.value for l in ALL_LAYOUTS])
    cm.add_argument("--repeats", type=int, default=5, help="rounds per grid point (median; ties between layouts are within a few %%)")
    cm.add_argument("--numerics", choices=NUMERICS_MODES, default="fast", help="engine numerics (models/numerics.py)")
    cm.add_argument("--measured", help="reuse a bench layouts JSON instead of measuring again")
    cm.add_argument("--json", default="bench_costmodel.json", help="output JSON path")
    args = parser.parse_args(argv)
    if args.verb == "costmodel":
        from splash_rollout.bench.costmodel import predict, summarize

        measured = json.load(open(args.measured)) if args.measured else cmd_layouts(args)
        points = predict(measured["points"], args.model, args.profile, args.world_size)
        out = {"profile": args.profile, **summarize(points), "points": points}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(json.dumps({k: out[k] for k in ("profile", "median_abs_error", "best_layout_agreement")}))
        return 0
    if args.verb == "switch":
        out = cmd_switch(args)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print_switch_table(out)
        return 0
    out = cmd_layouts(args)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    plot_layouts(out, args.png)
    print(json.dumps(out["fastest"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
