"""Sharded loading, measured: what an engine's ranks and its driver hold of a checkpoint.

Two checkpoints that differ only in their routed experts (glm5-nano's shape with a wider expert,
``--moe-intermediate``, and ``--experts-a`` / ``--experts-b`` routed experts; float32 safetensors
written here) are each served by

* a 2-rank spawned engine (feed-forward sharded, TP): each rank should hold half of the experts, so
  its memory grows by about half the difference D between the checkpoints, and the driver's by
  nothing that scales with them;
* a 1-rank engine in the measuring process: it holds the whole model once, no second copy.

Each measurement is a fresh driver process (``--child``) that samples the anonymous resident memory
(``RssAnon``) of itself and of its ranks every 2 ms while the engine is built and serves
(``memory_probe.AnonPeak``: a memory-mapped file's pages are page cache, not a rank's), then reads
each rank's resident set once serving. The 2-rank run then switches to DP-attention and back,
reading every rank's weight bytes in each layout against ``python -m splash_rollout.layout
footprint`` (TP: H/T of the switchable projections; DP-attention: all of them). Reported per rank:
peak anonymous growth B - A and resident-set growth B - A as fractions of D (the criterion: <= 0.65);
the driver's peak growth B - A / D (<= 0.1); the 1-rank engine's peak growth over its KV pool as a
multiple of its weight bytes (<= 1.2).

    python benchmarks/sharded_load.py --json docs/results/sharded_load.json            # D = 1.02 GB
    python benchmarks/sharded_load.py --json /tmp/sl.json --experts-b 24                # D = 113 MB, quick
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.memory_probe import AnonPeak, rss_bytes  # noqa: E402

PROMPTS = [[3 + (7 * i + j) % 500 for j in range(12 + i)] for i in range(8)]


def nano_config(experts: int, moe_intermediate: int):
    """glm5-nano with ``experts`` routed experts of width ``moe_intermediate`` (nothing else changes)."""
    from splash_rollout.models.config import PRESETS

    return PRESETS["glm5-nano"].replace(name=f"nano-{experts}x{moe_intermediate}", n_routed_experts=experts,
                                        moe_intermediate_size=moe_intermediate)


def routed_expert_bytes(config) -> int:
    """float32 bytes of the routed experts and their router rows."""
    per_layer = config.n_routed_experts * (3 * config.moe_intermediate_size * config.hidden_size + config.hidden_size + 1)
    return 4 * per_layer * len(config.moe_layers)


def write_checkpoint(path: str, config, seed: int = 0) -> None:
    from splash_rollout.models.model import MLAForCausalLM
    from splash_rollout.models.weights import save_checkpoint

    save_checkpoint(MLAForCausalLM.from_config(config, seed=seed), path)


def predicted_weight_bytes(model_config, layout: str, world_size: int) -> int:
    """What ``python -m splash_rollout.layout footprint`` says a float32 rank holds in ``layout``."""
    from splash_rollout.layout import Layout, attention_weight_bytes_per_rank, other_weight_bytes_per_rank
    from splash_rollout.layout.bytes import AttentionBytes

    sizes = AttentionBytes.from_model(model_config, "fp32", "fp32")
    return (attention_weight_bytes_per_rank(Layout.parse(layout), sizes, world_size)
            + other_weight_bytes_per_rank(model_config, world_size, "fp32", "sharded", "replicated"))


def child(checkpoint: str, world_size: int, pack_weights: bool) -> dict:
    """One driver: build the engine on ``checkpoint`` and serve, sampling every process's RssAnon."""
    from splash_rollout import EngineConfig, RolloutEngine, SamplingParams
    from splash_rollout.models.config import resolve_model

    config = EngineConfig(model=checkpoint, parallel={"world_size": world_size, "layout": "tp"},
                          memory={"num_pages": 64, "page_size": 16},
                          compute={"pack_weights": pack_weights, "speculation": "off"})
    sampling = SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=1)
    probe = AnonPeak().start()
    start = time.perf_counter()
    engine = RolloutEngine(config)
    built_s = time.perf_counter() - start
    engine.generate(PROMPTS, sampling)
    served = engine.memory_stats()
    pids = engine.worker_group.pids if engine.worker_group is not None else [os.getpid()]
    rss_after = [rss_bytes(p) for p in pids]
    peaks = probe.stop()
    out = {"checkpoint": checkpoint, "world_size": world_size, "pack_weights": pack_weights,
           "build_s": round(built_s, 3), "driver_baseline_anon": probe.baseline,
           "driver_peak_anon": peaks.get(os.getpid(), probe.baseline),
           "rank_peak_anon": [peaks.get(p) for p in pids] if world_size > 1 else None,
           "rank_rss_serving": rss_after, "memory_stats": served}
    if world_size > 1:  # a switch into the layout that replicates the projections, and back
        model_config = resolve_model(checkpoint)
        layouts = {}
        for layout in ("dp", "tp"):
            engine.switch_layout(layout)
            engine.generate(PROMPTS[:2], sampling)
            layouts[layout] = {"weights": [s["weights"] for s in engine.memory_stats()],
                               "predicted": predicted_weight_bytes(model_config, layout, world_size)}
        out["after_switch"] = layouts
        out["predicted_tp"] = predicted_weight_bytes(model_config, "tp", world_size)
    engine.shutdown()
    return out


def run_child(checkpoint: str, world_size: int, pack_weights: bool, timeout_s: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", checkpoint, "--world-size", str(world_size)]
    if not pack_weights:
        cmd.append("--no-pack-weights")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"child {cmd} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(work_dir: str, experts_a: int, experts_b: int, moe_intermediate: int, pack_weights: bool = False,
            timeout_s: float = 900.0) -> dict:
    """Both checkpoints written under ``work_dir``, each served by a 2-rank engine and a 1-rank one."""
    configs = {"a": nano_config(experts_a, moe_intermediate), "b": nano_config(experts_b, moe_intermediate)}
    paths = {k: os.path.join(work_dir, f"ckpt_{k}") for k in configs}
    for k, cfg in configs.items():
        if not os.path.isfile(os.path.join(paths[k], "model.safetensors")):
            write_checkpoint(paths[k], cfg)
    diff = routed_expert_bytes(configs["b"]) - routed_expert_bytes(configs["a"])
    runs = {(k, t): run_child(paths[k], t, pack_weights, timeout_s) for t in (2, 1) for k in ("a", "b")}
    a2, b2, b1 = runs["a", 2], runs["b", 2], runs["b", 1]
    rank_peak = [(pb - pa) / diff for pa, pb in zip(a2["rank_peak_anon"], b2["rank_peak_anon"])]
    rank_rss = [(rb - ra) / diff for ra, rb in zip(a2["rank_rss_serving"], b2["rank_rss_serving"])]
    driver = ((b2["driver_peak_anon"] - b2["driver_baseline_anon"])
              - (a2["driver_peak_anon"] - a2["driver_baseline_anon"])) / diff
    one = b1["memory_stats"][0]
    one_rank_growth = b1["driver_peak_anon"] - b1["driver_baseline_anon"]
    summary = {
        "difference_bytes": diff,
        "rank_peak_anon_growth_over_difference": rank_peak,
        "rank_rss_growth_over_difference": rank_rss,
        "driver_peak_anon_growth_over_difference": driver,
        "one_rank_peak_growth_over_weights": (one_rank_growth - one["kv_pool"]) / one["weights"],
        "one_rank_difference_growth_over_difference": (
            (b1["driver_peak_anon"] - b1["driver_baseline_anon"]) - (runs["a", 1]["driver_peak_anon"]
                                                                     - runs["a", 1]["driver_baseline_anon"])) / diff,
        "weights_equal_footprint": {
            "tp": all(s["weights"] == b2["predicted_tp"] for s in b2["memory_stats"]),
            **{layout: all(w == v["predicted"] for w in v["weights"]) for layout, v in b2["after_switch"].items()}},
    }
    summary["criteria"] = {
        "rank_peak_anon <= 0.65 D": max(rank_peak) <= 0.65,
        "rank_rss <= 0.65 D": max(rank_rss) <= 0.65,
        "driver <= 0.1 D": driver <= 0.1,
        "one rank <= 1.2 x weights": summary["one_rank_peak_growth_over_weights"] <= 1.2,
        "weights == footprint (tp, dp, tp)": all(summary["weights_equal_footprint"].values()),
    }
    return {"summary": summary, "configs": {k: c.name for k, c in configs.items()},
            "runs": {f"{k}_t{t}": v for (k, t), v in runs.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="output JSON path")
    ap.add_argument("--experts-a", type=int, default=8)
    ap.add_argument("--experts-b", type=int, default=152, help="routed experts of the larger checkpoint")
    ap.add_argument("--moe-intermediate", type=int, default=1536)
    ap.add_argument("--pack-weights", action="store_true",
                    help="serve with compute.pack_weights (a packed copy of each float32 weight used by >16 rows)")
    ap.add_argument("--work-dir", help="where the checkpoints go (default: a temporary folder)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--world-size", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--no-pack-weights", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.world_size, not args.no_pack_weights)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(args.work_dir or tmp, args.experts_a, args.experts_b, args.moe_intermediate, args.pack_weights)
    result["date"] = time.strftime("%Y-%m-%d")
    result["command"] = " ".join(sys.argv)
    print(json.dumps(result["summary"], indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if all(result["summary"]["criteria"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
