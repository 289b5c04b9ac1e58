"""Per-step records of a GRPO run under slash keys: rollout/*, reward/*, perf/*, layout/*, memory/*,
timing_s/*.

``WALL_CLOCK_PREFIXES`` names the records that measure time or the process's resident set, or follow
them -- under ``speculation="auto"`` the gate drafts where measured seconds say it pays, so the
engine's steps, the drafts, the KV occupancy per step and (where a stopped call cuts its samples,
which the next step resumes) the prompt rows prefilled and found cached follow the clock (the tokens
do not) -- and
so differ between two runs of the same numbers; everything else in a row is a function of the run's
config and seed (reproducible numerics: bit for bit, also across a checkpoint and resume).
"""
from __future__ import annotations

import numpy as np
import torch

from splash_rollout.recipes.grpo.reward_fns import Rewards
from splash_rollout.reporting.timeline_report import layout_metrics
from splash_rollout.rollout.types import RolloutBatch

WALL_CLOCK_PREFIXES = ("timing_s/", "perf/tokens_per_s", "layout/time_share/", "layout/switch_overhead_ms",
                       "memory/rss", "perf/engine_steps", "spec/", "memory/kv_used_", "rollout/prefill_rows",
                       "rollout/prefix_hit_tokens")


ENGINE_MEMORY_KEYS = ("rollout/retractions", "rollout/prefix_hit_tokens", "rollout/prefill_rows",
                      "memory/kv_used_peak", "memory/kv_used_mean")
"""The engine's KV memory records of a rollout call, passed through to the step's record."""


def is_wall_clock(key: str) -> bool:
    return key.startswith(WALL_CLOCK_PREFIXES)


def step_metrics(batch: RolloutBatch, rewards: torch.Tensor, scored: Rewards,
                 timings: dict[str, float]) -> dict[str, float]:
    """rewards [num_groups, n] (before shaping); ``scored``: the reward function's full output."""
    lens = np.array([len(s.response_ids) for s in batch.samples], dtype=np.float64)
    reasons = [s.finish_reason for s in batch.samples]
    timeline = batch.timeline.to_dict()
    tokens = float(lens.sum())
    gen_s = timings.get("timing_s/rollout", 0.0)
    group_std = rewards.std(dim=-1, unbiased=False)
    out = {"rollout/response_len/mean": float(lens.mean()), "rollout/response_len/max": float(lens.max()),
           "rollout/response_len/min": float(lens.min()), "rollout/response_len/p90": float(np.percentile(lens, 90)),
           "rollout/num_samples": float(len(lens)),
           "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std(unbiased=False)),
           "reward/accuracy": float(np.mean(scored.correct)),
           "reward/groups_with_signal": float((group_std > 0).float().mean()),
           "perf/tokens_per_s": tokens / max(gen_s, 1e-9), "perf/rollout_tokens": tokens,
           "perf/engine_steps": float(sum(p.get("steps", 0) for p in timeline["phases"]))}
    for name, values in sorted(scored.extras.items()):
        out[f"reward/{name}/mean"] = float(np.nanmean(values))
    for r in ("stop", "length", "abort"):
        out[f"rollout/finish_reason/{r}"] = reasons.count(r) / len(reasons)
    out.update(layout_metrics(timeline))
    out.update({k: v for k, v in batch.metrics.items()
                if k in ENGINE_MEMORY_KEYS or k.startswith(("tool/", "spec/", "fleet/"))})
    out.update(timings)
    return out


def memory_metrics(awake: list[dict], asleep: list[dict]) -> dict[str, float]:
    """Engine memory summed over ranks around ``sleep()`` (``RolloutEngine.memory_stats``):
    allocated KV pool + weight storage awake and asleep, what sleeping freed, and the resident sets."""
    held = lambda stats: float(sum((r.get("kv_pool") or 0) + (r.get("weights") or 0) for r in stats))
    rss = lambda stats: float(sum(r.get("rss") or 0 for r in stats))
    return {"memory/engine_bytes_awake": held(awake), "memory/engine_bytes_asleep": held(asleep),
            "memory/engine_bytes_freed": held(awake) - held(asleep),
            "memory/rss_awake": rss(awake), "memory/rss_asleep": rss(asleep)}
