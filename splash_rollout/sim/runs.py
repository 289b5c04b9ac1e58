"""The two simulated experiments: the fixed-layout input sweep (paper §5.2) and a draining rollout
(a GRPO-style step: P prompts x S samples, long-tailed responses) run in each fixed layout and
adaptively. Both return plain dicts in the JSON shapes ``python -m splash_rollout.sim`` writes.
"""
from __future__ import annotations

import math

import numpy as np

from splash_rollout.layout import ALL_LAYOUTS
from splash_rollout.scheduling import Deployment
from splash_rollout.sim.core import ADAPTIVE, SimConfig, SimResult, Workload, simulate

DEFAULT_INPUTS = tuple(1024 * k for k in (1, 4, 16, 32, 64, 128, 256, 512))


def sweep(dep: Deployment, batch: int, inputs=DEFAULT_INPUTS, output_len: int = 1024,
          cfg: SimConfig = SimConfig()) -> dict:
    """Total throughput B(L_in + output) / T_batch of each fixed layout at each input length, and the
    leader. A layout that cannot admit the batch at once runs it in waves; one that cannot hold even
    one request scores 0."""
    leaders, tps, notes = {}, {}, {}
    for length in inputs:
        work = Workload.make([length] * batch, output_len)
        row = {}
        for l in ALL_LAYOUTS:
            r = simulate(work, dep, l, cfg)
            row[l.value] = r.tokens_per_s
            if r.reason:
                notes[f"{length}/{l.value}"] = r.reason
        tps[str(length)] = row
        leaders[str(length)] = max(row, key=row.get)
    out = {"model": dep.model.name, "hardware": dep.profile.name, "batch": batch, "output_len": output_len,
           "leaders": leaders, "tokens_per_s": tps}
    if notes:
        out["notes"] = notes
    return out


def drain_workload(prompts: int = 512, samples: int = 16, prompt_len: tuple[int, int] = (2048, 2048),
                   response_lognormal: tuple[float, float] = (8.0, 1.0), max_response: int = 65536,
                   seed: int = 0) -> Workload:
    """P prompts (length uniform on [lo, hi]) x S samples each; responses lognormal(mu, sigma) clipped
    to [1, max_response]; admission reserves max_response."""
    rng = np.random.default_rng(seed)
    lo, hi = prompt_len
    plen = np.repeat(rng.integers(lo, hi + 1, size=prompts), samples)
    mu, sigma = response_lognormal
    resp = np.clip(np.rint(rng.lognormal(mu, sigma, size=prompts * samples)), 1, max_response).astype(np.int64)
    return Workload.make(plen, resp, max_response)


def _summary(r: SimResult) -> dict:
    return {"seconds": r.seconds if math.isfinite(r.seconds) else None, "tokens": r.tokens, "steps": r.steps,
            "tokens_per_s": r.tokens_per_s, "progress": [[round(t, 4), n] for t, n in r.progress]}


def drain(dep: Deployment, work: Workload, cfg: SimConfig = SimConfig()) -> dict:
    """Each fixed layout and the adaptive policy on the same workload."""
    results = {l.value: simulate(work, dep, l, cfg) for l in ALL_LAYOUTS}
    results[ADAPTIVE] = simulate(work, dep, ADAPTIVE, cfg)
    tps = {k: r.tokens_per_s for k, r in results.items()}
    best_fixed = max((k for k in tps if k != ADAPTIVE), key=tps.get)
    a = results[ADAPTIVE]
    return {
        "model": dep.model.name, "hardware": dep.profile.name, "requests": work.size,
        "total_tokens": work.total_tokens, "tokens_per_s": tps, "best_fixed": best_fixed,
        "ratio_adaptive_vs_best_fixed": tps[ADAPTIVE] / tps[best_fixed] if tps[best_fixed] else None,
        "ratio_adaptive_vs_dp": tps[ADAPTIVE] / tps["dp"] if tps["dp"] else None,
        "switch_path": " ".join([a.timeline[0]["layout"]] + [f"->{s['dst']}@{s['step']}" for s in a.switches])
        if a.timeline else "",
        "timeline": a.timeline, "switches": a.switches,
        "runs": {k: _summary(r) for k, r in results.items()},
    }


def paper_workload(short: int = 2048, long_prompts: int = 8, seed: int = 0) -> Workload:
    """The paper's framing: ``short`` requests with 1K-4K prompts and heavy-tailed responses
    (lognormal, median ~600 tokens, clipped at 16K), then ``long_prompts`` prompts of 256K-512K
    tokens with short answers, queued behind them (the long prompts arrive as the wide phase drains)."""
    rng = np.random.default_rng(seed)
    p_short = rng.integers(1024, 4097, size=short)
    r_short = np.clip(np.rint(rng.lognormal(6.4, 1.0, size=short)), 1, 16384).astype(np.int64)
    p_long = rng.integers(256 * 1024, 512 * 1024 + 1, size=long_prompts)
    r_long = rng.integers(256, 1025, size=long_prompts)
    return Workload.make(np.concatenate([p_short, p_long]), np.concatenate([r_short, r_long]),
                         np.concatenate([np.full(short, 16384), np.full(long_prompts, 1024)]))


WORKLOADS = ("paper", "rl", "wide-only", "tail-only", "long-prompt-only", "oscillating")
"""Named drains: ``paper`` (above); ``rl`` (the co-located GRPO drain: P prompts x S samples,
long-tailed responses); ``wide-only`` (the paper drain's short requests alone); ``tail-only`` (64
requests with long responses: the end of a drain); ``long-prompt-only`` (16 prompts of 256K-512K);
``oscillating`` (three rounds of 512 short requests then 4 long prompts)."""


RL_SAMPLES = 16
"""Samples per prompt of the named ``rl`` drain (its requests come in groups of this many)."""


def group_size(name: str | None, samples: int) -> int:
    """Requests per prompt group of a drain: ``samples`` for a generated one, ``RL_SAMPLES`` for the
    named ``rl``, 1 for the other named ones (single requests)."""
    return samples if name is None else RL_SAMPLES if name == "rl" else 1


def named_workload(name: str, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    if name == "paper":
        return paper_workload(seed=seed)
    if name == "rl":
        return drain_workload(prompts=64, samples=RL_SAMPLES, prompt_len=(1024, 4096), response_lognormal=(7.0, 1.0),
                              max_response=16384, seed=seed)
    if name == "wide-only":
        return paper_workload(long_prompts=0, seed=seed)
    if name == "tail-only":
        return Workload.make(rng.integers(1024, 4097, size=64), rng.integers(4096, 16385, size=64), 16384)
    if name == "long-prompt-only":
        return Workload.make(rng.integers(256 * 1024, 512 * 1024 + 1, size=16), rng.integers(256, 1025, size=16), 1024)
    if name == "oscillating":
        parts = [paper_workload(short=512, long_prompts=4, seed=seed + k) for k in range(3)]
        return Workload.make(np.concatenate([w.prompt for w in parts]), np.concatenate([w.output for w in parts]),
                             np.concatenate([w.max_new for w in parts]))
    raise ValueError(f"--workload: expected one of {WORKLOADS}, got {name!r}")
