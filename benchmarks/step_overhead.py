"""Per-step overhead of the engine core: control, batch build, forward and sampling, B x S grid.

For each batch size B and history length S, B requests are put straight into the decode state on
every rank (their pages granted through the real placement, the KV left zero: the step's cost does
not depend on the values), then a few decode steps run on T spawned ranks in ``--layout``. Reported
per point (median over the steps after the first): the step's wall time on the driver and its
split -- ``control`` (the driver's per-step message to the ranks, and its bytes), ``schedule``,
``batch`` (the ForwardBatch), ``forward`` and ``sample``.

The same script measures an engine core that keeps every page table on rank 0 and ships them each
step (``--core rank0``, run from a checkout of that core): there the message is the pickled step
plan and ``batch`` is ``ForwardBatch.build``. ``--compare OLD.json`` puts such a run's numbers next
to this one's with ratios.

    python benchmarks/step_overhead.py --json docs/results/step_overhead.json \
        --compare docs/results/step_overhead_rank0_core.json
    python benchmarks/step_overhead.py --json /tmp/s.json --batches 16 --contexts 256   # quick
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from splash_rollout.distributed.launch import WorkerGroup  # noqa: E402
from splash_rollout.engine.request import Request, RequestStatus, SamplingSpec  # noqa: E402
from splash_rollout.layout.layouts import Layout  # noqa: E402
from splash_rollout.models.config import PRESETS  # noqa: E402
from splash_rollout.models.model import MLAForCausalLM  # noqa: E402

SPLIT = ("control", "schedule", "batch", "forward", "sample")


def bench_model(context: int):
    """glm5-nano with one decoder layer and a context window that holds ``context`` tokens."""
    return PRESETS["glm5-nano"].replace(num_layers=1, first_k_dense_replace=1, indexer_types=("full",),
                                        max_position_embeddings=max(4096, 2 * context))


def warm_requests(cfg, batch: int, context: int) -> list[Request]:
    """B requests whose first ``context - 1`` tokens count as computed (the next step decodes)."""
    spec = SamplingSpec(temperature=1.0, max_new_tokens=8, ignore_eos=True)
    return [Request(i, [3 + (i + k) % 500 for k in range(context)], spec, cfg.max_position_embeddings)
            for i in range(batch)]


def admit_as_decoding(scheduler, requests: list[Request]) -> None:
    """Put ``requests`` into the running set with their history's pages granted (deterministic: every
    replica that calls this with the same requests ends in the same state)."""
    for r in requests:
        scheduler.placement.start(r, scheduler.placement.owners_by_balance()[0])
        scheduler.placement.grow(r, r.num_prompt_tokens - 1)
        r.num_computed_tokens = r.num_prompt_tokens - 1
        r.status = RequestStatus.RUNNING
        scheduler.running.append(r)


def point_on_rank(ctx, core: str, layout: str, batch: int, context: int, steps: int, page_size: int):
    torch.set_flush_denormal(True)
    cfg = bench_model(context)
    per_rank = batch if layout == "tp" else -(-batch // ctx.world_size)  # TP stores every history everywhere
    pages = per_rank * (-(-(context + 16) // page_size)) + batch
    model = MLAForCausalLM.from_config(cfg, seed=0).eval()
    if core == "rank0":
        return _rank0_core(ctx, cfg, model, layout, batch, context, steps, page_size, pages)
    from splash_rollout.engine.rank_engine import Engine
    from splash_rollout.rollout.build import engine_settings
    from splash_rollout.rollout.config import EngineConfig

    settings = engine_settings(EngineConfig(model=cfg, parallel=dict(world_size=ctx.world_size, layout=layout),
                                            memory=dict(num_pages=pages, page_size=page_size),
                                            batching=dict(max_num_batched_tokens=batch, max_num_seqs=batch),
                                            compute=dict(speculation="off")))
    engine = Engine(model, cfg, ctx.groups, settings)
    admit_as_decoding(engine.scheduler, warm_requests(cfg, batch, context))  # every rank: its replica
    engine.serve([], max_steps=steps)
    engine.abort_all()
    if ctx.rank:
        return None
    return [dict(s.split_s, seconds=s.seconds, control_bytes=s.control_bytes) for s in engine.step_log]


def _rank0_core(ctx, cfg, model, layout, batch, context, steps, page_size, pages):
    """The core that keeps page tables on rank 0 (``engine.group_engine.GroupEngine``), timed from outside."""
    import pickle

    import splash_rollout.engine.group_engine as ge

    engine = ge.GroupEngine(model, cfg, ctx.groups, layout=Layout.parse(layout), num_pages=pages,
                            page_size=page_size, max_num_batched_tokens=batch, max_num_seqs=batch)
    laps: dict[str, float] = {}
    plan_bytes: list[int] = []

    def timed(name, fn):
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                laps[name] = laps.get(name, 0.0) + time.perf_counter() - t
        return run

    real_broadcast = engine.control.broadcast_object

    def broadcast(obj=None, src=0):
        if ctx.rank == 0 and isinstance(obj, ge.StepPlan):
            plan_bytes.append(len(pickle.dumps(obj)))
        return timed("control", real_broadcast)(obj, src)

    engine.control.broadcast_object = broadcast
    engine._plan = timed("control", engine._plan)  # building the plan's page tables is control work
    ge.ForwardBatch.build = staticmethod(timed("batch", ge.ForwardBatch.build))
    engine.runner.forward = timed("forward", engine.runner.forward)
    ge.sample = timed("sample", ge.sample)
    if ctx.rank == 0:
        admit_as_decoding(engine.scheduler, warm_requests(cfg, batch, context))
        engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    records = []
    for _ in range(steps):
        laps.clear()
        engine.serve(None, max_steps=1)
        if ctx.rank == 0:
            records.append(dict({k: laps.get(k, 0.0) for k in SPLIT}, seconds=engine.step_log[-1].seconds,
                                control_bytes=plan_bytes[-1] if plan_bytes else 0))
    if ctx.rank == 0:
        engine.scheduler.abort_all()
    engine.serve(None)
    return records if ctx.rank == 0 else None


def summarize(records: list[dict]) -> dict:
    steady = records[1:] or records
    out = {k: 1e3 * statistics.median(r[k] for r in steady) for k in SPLIT}
    out = {f"{k}_ms": v for k, v in out.items()}
    out["step_ms"] = 1e3 * statistics.median(r["seconds"] for r in steady)
    out["control_bytes"] = int(statistics.median(r["control_bytes"] for r in steady))
    out["control_plus_batch_fraction"] = (out["control_ms"] + out["batch_ms"]) / out["step_ms"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--core", choices=("workers", "rank0"), default="workers",
                    help="workers: page tables on every rank (this package); rank0: the older core, run from its checkout")
    ap.add_argument("--layout", default="dp")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--batches", default="16,256,1024")
    ap.add_argument("--contexts", default="256,8192")
    ap.add_argument("--steps", type=int, default=4, help="decode steps per point (the first is not counted)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--compare", help="a --core rank0 result JSON to report side by side")
    args = ap.parse_args(argv)
    points = []
    with WorkerGroup(args.world_size, timeout_s=900, threads_per_rank=1) as group:
        for b in [int(x) for x in args.batches.split(",")]:
            for s in [int(x) for x in args.contexts.split(",")]:
                t0 = time.perf_counter()
                records = group.run(point_on_rank, args.core, args.layout, b, s, args.steps, args.page_size)[0]
                points.append({"batch": b, "context": s, **summarize(records)})
                print(f"  B={b:5d} S={s:5d}: {points[-1]['step_ms']:8.1f} ms/step, control "
                      f"{points[-1]['control_bytes']} B, control+batch {100 * points[-1]['control_plus_batch_fraction']:.1f} % "
                      f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    result = {"core": args.core, "layout": args.layout, "world_size": args.world_size, "page_size": args.page_size,
              "model": "glm5-nano, 1 layer", "points": points}
    if args.compare:
        with open(args.compare) as f:
            old = {(p["batch"], p["context"]): p for p in json.load(f)["points"]}
        result["compare"] = [{"batch": p["batch"], "context": p["context"],
                              "control_bytes": [old[k]["control_bytes"], p["control_bytes"]],
                              "step_ms": [old[k]["step_ms"], p["step_ms"]],
                              "control_plus_batch_ms": [old[k]["control_ms"] + old[k]["batch_ms"],
                                                        p["control_ms"] + p["batch_ms"]],
                              "step_speedup": old[k]["step_ms"] / p["step_ms"]}
                             for p in points if (k := (p["batch"], p["context"])) in old]
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result.get("compare", points), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
