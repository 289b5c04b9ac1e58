"""A fleet draining one RL step: R replicas of T ranks, each with its own share and its own layouts.

Why: at the scale our users run, a step's prompts are spread over tens of engines (``Fleet``), and
two questions decide what the fleet gets out of SPLASH: whether each replica switching on its own
still beats one fixed layout for the whole fleet (a replica's share drains at its own pace, so its
wide and tail phases come at their own times), and how much the placement of the prompt groups
matters (the step ends with the slowest replica).

Every group of a prompt's ``S`` samples goes to one replica, as ``Fleet`` places it. Placements:

* ``round_robin``: group g to replica g mod R.
* ``by_load``: groups in order, each to the replica with the least expected work so far -- its
  samples' prompt tokens plus their expected responses (every response expected equal: lengths are
  unknown when a group is placed). Where prompt lengths vary this balances prefill work that
  round robin leaves to chance; with equal prompts it is round robin.

Each replica is simulated alone on its share (``core.simulate``, the same model as ``drain``): in
every fixed layout and adaptively. The fleet's step ends when its last replica does; its
throughput is all tokens over that time.
"""
from __future__ import annotations

import math

import numpy as np

from splash_rollout.layout import ALL_LAYOUTS
from splash_rollout.scheduling import Deployment
from splash_rollout.sim.core import ADAPTIVE, SimConfig, Workload, simulate

PLACEMENTS = ("round_robin", "by_load")


def place(work: Workload, group_size: int, replicas: int, placement: str) -> list[np.ndarray]:
    """Per replica, the request positions it serves. ``work``'s requests come in groups of
    ``group_size`` consecutive positions (a prompt's samples)."""
    if work.size % group_size:
        raise ValueError(f"fleet: {work.size} requests are not whole groups of {group_size}")
    groups = work.size // group_size
    if placement == "round_robin":
        owner = np.arange(groups) % replicas
    elif placement == "by_load":
        expected_response = float(work.output.mean())
        load, owner = np.zeros(replicas), np.empty(groups, dtype=np.int64)
        for g in range(groups):
            r = int(np.argmin(load))  # argmin keeps the first of equals: round robin while balanced
            owner[g] = r
            load[r] += float(work.prompt[g * group_size:(g + 1) * group_size].sum()) + group_size * expected_response
    else:
        raise ValueError(f"fleet: placement expected one of {PLACEMENTS}, got {placement!r}")
    per_request = np.repeat(owner, group_size)
    return [np.flatnonzero(per_request == r) for r in range(replicas)]


def _share(work: Workload, idx: np.ndarray) -> Workload:
    return Workload.make(work.prompt[idx], work.output[idx], work.max_new[idx])


def fleet_drain(dep: Deployment, work: Workload, group_size: int, replicas: int,
                cfg: SimConfig = SimConfig()) -> dict:
    """Each placement, and under it the fleet in each fixed layout and adaptive (each replica
    switching on its own); ratios of adaptive against the best fixed layout for the whole fleet."""
    if replicas < 1:
        raise ValueError(f"--replicas: expected >= 1, got {replicas}")
    out = {"model": dep.model.name, "hardware": dep.profile.name, "replicas": replicas,
           "ranks_per_replica": dep.world_size, "requests": work.size, "group_size": group_size,
           "total_tokens": work.total_tokens, "placements": {}}
    for placement in PLACEMENTS:
        shares = [_share(work, idx) for idx in place(work, group_size, replicas, placement)]
        modes = {l.value: l for l in ALL_LAYOUTS} | {ADAPTIVE: ADAPTIVE}
        per_mode = {}
        for name, mode in modes.items():
            runs = [simulate(s, dep, mode, cfg) if s.size else None for s in shares]
            seconds = [r.seconds for r in runs if r is not None]
            makespan = max(seconds) if seconds else 0.0
            per_mode[name] = {
                "seconds": makespan if math.isfinite(makespan) else None,
                "tokens_per_s": work.total_tokens / makespan if makespan > 0 and math.isfinite(makespan) else 0.0,
                "replica_seconds": [r.seconds if r is not None and math.isfinite(r.seconds) else None for r in runs],
                "replica_requests": [int(s.size) for s in shares],
                **({"switch_paths": [" ".join([r.timeline[0]["layout"]] + [f"->{w['dst']}@{w['step']}"
                                                                           for w in r.switches])
                                     if r is not None and r.timeline else "" for r in runs]}
                   if name == ADAPTIVE else {}),
            }
        tps = {k: v["tokens_per_s"] for k, v in per_mode.items()}
        best_fixed = max((k for k in tps if k != ADAPTIVE), key=tps.get)
        out["placements"][placement] = {
            "tokens_per_s": tps, "best_fixed": best_fixed,
            "ratio_adaptive_vs_best_fixed": tps[ADAPTIVE] / tps[best_fixed] if tps[best_fixed] else None,
            "runs": per_mode}
    rr, bl = (out["placements"][p]["tokens_per_s"][ADAPTIVE] for p in PLACEMENTS)
    out["ratio_by_load_vs_round_robin"] = bl / rr if rr else None
    return out


def summary_line(result: dict) -> str:
    parts = []
    for placement, r in result["placements"].items():
        parts.append(f"{placement}: adaptive {r['tokens_per_s'][ADAPTIVE]:.0f} tok/s, best fixed "
                     f"{r['best_fixed']} {r['tokens_per_s'][r['best_fixed']]:.0f} "
                     f"(x{r['ratio_adaptive_vs_best_fixed']:.3f})")
    return "  ".join(parts) + f"  by_load/round_robin x{result['ratio_by_load_vs_round_robin']:.3f}"
