"""``python -m splash_rollout.calibrate --world-size T --out profile.yaml``: measure θ on this machine.

Spawns T ranks (gloo on CPU), runs the probes of ``probes.py`` on each, takes the slowest rank's
numbers, and writes a YAML profile that ``EngineConfig(profile=...)`` and the scheduler read.
"""
from __future__ import annotations

import argparse
import sys

from splash_rollout.scheduling.profile import CollectiveCost, HardwareProfile, save_profile


def calibrate(world_size: int, memory_gib: float) -> HardwareProfile:
    from splash_rollout.calibrate.probes import probe_rank
    from splash_rollout.distributed.launch import WorkerGroup

    with WorkerGroup(world_size, timeout_s=120) as group:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m splash_rollout.calibrate", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="ranks T to measure")
    parser.add_argument("--memory-gib", type=float, default=1.0, help="per-rank memory recorded in the profile")
    parser.add_argument("--out", default="profile.yaml", help="YAML profile path")
    args = parser.parse_args(argv)
    if args.world_size < 1:
        print(f"{parser.prog}: error: --world-size: expected a positive integer, got {args.world_size}",
              file=sys.stderr)
        return 2
    profile = calibrate(args.world_size, args.memory_gib)
    save_profile(profile, args.out)
    for k, v in profile.to_dict().items():
        print(f"{k:>18}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
