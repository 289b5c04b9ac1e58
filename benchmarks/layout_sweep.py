"""Fixed-layout sweep in the paper's form (§5.2), scaled to CPU: total throughput per layout.

Grid: input length L_in x batch size B, output length L_out fixed. For each fixed layout on T
spawned CPU ranks, total throughput = B (L_in + L_out) / T_batch, where T_batch is the time to
serve the batch: one prefill step for all B prompts plus L_out - 1 decode steps. The step times come
from ``splash_rollout.bench.layouts.bench_on_rank`` (the ``python -m splash_rollout.bench layouts``
machinery: a warm-up batch, then fresh batches per grid point, median prefill step and median decode
step), so T_batch = t_prefill + (L_out - 1) t_decode. The decode median is taken over the first few
decode steps; at these sizes a decode step's time is dominated by weights and collectives, so it
barely grows over 32 more tokens (the JSON keeps both medians to check against).

    python benchmarks/layout_sweep.py --json docs/results/layout_sweep.json --png docs/results/layout_sweep.png
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from splash_rollout.bench.layouts import bench_on_rank  # noqa: E402
from splash_rollout.cli_args import positive_ints  # noqa: E402
from splash_rollout.distributed.launch import WorkerGroup  # noqa: E402
from splash_rollout.layout.layouts import ALL_LAYOUTS  # noqa: E402


def throughput(points: list[dict], output_len: int) -> list[dict]:
    """Per grid point and layout: T_batch (s) and total tokens/s B (L_in + L_out) / T_batch."""
    rows = []
    for p in points:
        t_batch = 1e-3 * (p["prefill_ms"] + (output_len - 1) * p["decode_ms"])
        rows.append({"layout": p["layout"], "batch": p["batch"], "input_len": p["context"], "output_len": output_len,
                     "prefill_ms": p["prefill_ms"], "decode_ms": p["decode_ms"], "batch_s": t_batch,
                     "tokens_per_s": p["batch"] * (p["context"] + output_len) / t_batch})
    return rows


def leaders(rows: list[dict]) -> dict[str, dict[str, str]]:
    """{"B16": {"1024": "dp", ...}}: the fastest layout per batch size and input length."""
    best: dict[tuple[int, int], dict] = {}
    for r in rows:
        key = (r["batch"], r["input_len"])
        if key not in best or r["tokens_per_s"] > best[key]["tokens_per_s"]:
            best[key] = r
    out: dict[str, dict[str, str]] = {}
    for (b, s), r in sorted(best.items()):
        out.setdefault(f"B{b}", {})[str(s)] = r["layout"]
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["points"]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.8), squeeze=False)
    for ax, b in zip(axes[0], batches):
        for layout in result["layouts"]:
            pts = sorted((r["input_len"], r["tokens_per_s"]) for r in rows if r["batch"] == b and r["layout"] == layout)
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=layout)
        ax.set_xscale("log", base=2)
        ax.set_title(f"B={b}, L_out={result['output_len']}")
        ax.set_xlabel("input length L_in")
        ax.set_ylabel("B(L_in+L_out)/T_batch  (tokens/s)")
        ax.legend()
    fig.suptitle(f"fixed-layout sweep, {result['model']} on {result['world_size']} CPU ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="output JSON path")
    ap.add_argument("--png", help="throughput per layout vs input length, one panel per batch size")
    ap.add_argument("--model", default="glm5-nano")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--inputs", type=positive_ints, default=[64, 256, 1024], help="input lengths L_in")
    ap.add_argument("--batches", type=positive_ints, default=[1, 4, 16], help="batch sizes B")
    ap.add_argument("--output-len", type=int, default=32, help="L_out")
    ap.add_argument("--layouts", type=lambda t: t.split(","), default=[l.value for l in ALL_LAYOUTS])
    ap.add_argument("--repeats", type=int, default=3, help="fresh batches per grid point (median)")
    args = ap.parse_args(argv)
    if args.output_len < 2:
        ap.error("--output-len: expected >= 2")
    extra = {"repeats": args.repeats} if "repeats" in inspect.signature(bench_on_rank).parameters else {}
    points, seconds = [], {}
    start_all = time.perf_counter()
    with WorkerGroup(args.world_size, timeout_s=600) as group:
        for layout in args.layouts:
            start = time.perf_counter()
            points += group.run(bench_on_rank, args.model, layout, args.batches, args.inputs, timeout_s=3600,
                                **extra)[0]
            seconds[layout] = time.perf_counter() - start
            print(f"  {layout}: {seconds[layout]:.1f} s", file=sys.stderr)
    rows = throughput(points, args.output_len)
    result = {"model": args.model, "world_size": args.world_size, "output_len": args.output_len,
              "inputs": args.inputs, "batches": args.batches, "layouts": args.layouts,
              "repeats": extra.get("repeats", 1), "leaders": leaders(rows),
              "method": "T_batch = median prefill step + (L_out - 1) x median decode step (bench layouts)",
              "wall_s_per_layout": seconds, "wall_s": time.perf_counter() - start_all,
              "cpu_count": os.cpu_count(), "load_average_at_end": os.getloadavg(), "points": rows}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    if args.png:
        plot(result, args.png)
    print(json.dumps(result["leaders"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
