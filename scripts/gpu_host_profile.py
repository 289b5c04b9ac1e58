"""Where a GPU decode step's time goes: the engine's step split and torch.profiler's view of a few steps.

device_check.sh showed the engine's decode step on an H200 at 22-30x the HBM bound and flat in the
batch size, i.e. bound by the host. This script says by what: the mean decode step split (control,
schedule, batch, forward, sample) over 23 greedy steps at B = 64 (speculation off) on device_check's
throughput model, and torch.profiler over 8 more tokens: kernel launches, aten ops, host syncs
(``aten::item``, ``cudaStreamSynchronize``) and GPU time (the kernel and copy rows only: an aten
op's row repeats its kernels' time) against CPU time. ``--cuda-graphs auto|on|off`` (default off:
the eager step) profiles the graphed engine instead. Writes ``host_profile.json`` and
``host_profile_ops.txt`` (the top ops by self CPU time) under ``--out``.

    python scripts/gpu_host_profile.py --out "$OUT"                 # on the GPU machine
    python scripts/gpu_host_profile.py --cuda-graphs on --out "$OUT"
    python scripts/gpu_host_profile.py --cpu --tiny --out /tmp/hp   # a check of the script on a CPU
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import device_check as dc  # noqa: E402 -- beside this file

STEPS_TOKENS = 24
"""Greedy tokens of the timed call whose decode steps are split."""
PROFILED_TOKENS = 8
"""Tokens of the profiled call (one prefill step, the rest decode)."""


def decode_split(steps: list) -> dict:
    """Mean decode step, ms, and its phases (the step log's ``split_s``)."""
    decode = [s for s in steps if not s.prefill_rows]
    split: dict[str, float] = {}
    for s in decode:
        for phase, seconds in s.split_s.items():
            split[phase] = split.get(phase, 0.0) + 1e3 * seconds / len(decode)
    return {"decode_steps": len(decode), "mean_step_ms": 1e3 * sum(s.seconds for s in decode) / len(decode),
            "mean_split_ms": split}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    graphs = "off"
    if "--cuda-graphs" in argv:  # this script's own flag; the rest are device_check's
        at = argv.index("--cuda-graphs")
        graphs = argv[at + 1]
        del argv[at: at + 2]
        if graphs not in ("auto", "on", "off"):
            raise SystemExit(f"--cuda-graphs: expected auto, on or off, got {graphs!r}")
    args = dc.parse_args(argv)
    args.cuda_graphs = graphs
    os.makedirs(args.out, exist_ok=True)
    ctx = dc.Ctx(args)
    torch = ctx.torch
    import splash_rollout.rollout.engine as rollout_engine
    from splash_rollout import EngineConfig, RolloutEngine, SamplingParams

    captured: list[list] = []  # StepRecord lists
    build_timeline = rollout_engine.build_timeline

    def keep_steps(steps, *rest, **kw):  # the call's step log, which RolloutBatch does not carry
        captured.append(steps)
        return build_timeline(steps, *rest, **kw)

    rollout_engine.build_timeline = keep_steps
    config = dc.throughput_model(ctx)
    batch = 4 if ctx.tiny else 64
    backend = "torch" if args.cpu else "triton"
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, config.vocab_size, (16,), generator=g).tolist() for _ in range(batch)]
    res: dict = {"B": batch, "backend": backend}
    res["cuda_graphs"] = args.cuda_graphs
    with RolloutEngine(EngineConfig(model=config, device=ctx.device, dtype="bfloat16", attention_backend=backend,
                                    page_size=64, max_num_seqs=batch, max_num_batched_tokens=4096,
                                    num_pages=batch * 4 + 8, speculation="off",
                                    cuda_graphs=args.cuda_graphs if ctx.device == "cuda" else "off")) as eng:
        greedy = SamplingParams(temperature=0.0, max_new_tokens=STEPS_TOKENS, ignore_eos=True)
        eng.generate(prompts, greedy)  # warm-up: kernel compiles
        ctx.sync()
        t0 = time.perf_counter()
        eng.generate(prompts, greedy)
        ctx.sync()
        res["wall_s"] = time.perf_counter() - t0
        res.update(decode_split(captured[-1]))
        ops = dc.profile_greedy(ctx, eng, prompts, PROFILED_TOKENS)
    with open(os.path.join(args.out, "host_profile_ops.txt"), "w") as f:
        f.write(ops.table(sort_by="self_cpu_time_total", row_limit=40))
    res.update(profiled_tokens=PROFILED_TOKENS, kernel_launches_total=dc.op_count(ops, *dc.KERNEL_LAUNCHES),
               graph_launches_total=dc.op_count(ops, "cudaGraphLaunch"),
               aten_ops_total=sum(e.count for e in ops if e.key.startswith("aten::")),
               item_calls_total=dc.op_count(ops, "aten::item"),
               stream_syncs_total=dc.op_count(ops, "cudaStreamSynchronize"),
               # GPU time: the device rows only (kernels, copies); an aten op's row repeats its kernels' time
               device_time_total_ms=sum(e.self_device_time_total for e in ops
                                        if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3,
               cpu_time_total_ms=sum(e.self_cpu_time_total for e in ops) / 1e3)
    with open(os.path.join(args.out, "host_profile.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
