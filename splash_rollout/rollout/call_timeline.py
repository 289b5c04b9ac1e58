"""Building the public layout timeline of a generate call from the engine's step and switch logs.

A phase is a run of consecutive steps in one layout: ``layout``, ``t_start`` / ``t_end`` (seconds
from the start of the call), ``steps``, ``batch_size_start`` / ``batch_size_end`` (running requests),
``tokens`` (query rows processed), ``batch_curve`` ([t, running] pairs: the phase's start, every step
where the batch has moved by a fifth since the last pair -- drained, or refilled from the queue --
and its end: the drain's shape in O(log B) points), ``memory_curve`` ([t, used, expected] triples:
the busiest rank's KV pages in use, and in use plus the running requests' expected growth, as
fractions of its pool; a point whenever either moved by 0.05), ``speculation_spans`` ([t0, t1] of
each run of steps that verified drafted tokens). A switch record keeps ``src``, ``dst``, ``step``, ``cause``
(request, schedule, policy or pressure), ``bytes_sent``
and ``bytes_received`` (one entry per rank), ``overhead_ms`` (time the switching step waited for
switch state), ``blocking_estimate_ms`` and ``deferred_reason`` (None when it happened).
"""
from __future__ import annotations

from typing import Any

from splash_rollout.engine.drafter import DRAFT_SOURCES
from splash_rollout.engine.step_log import StepRecord
from splash_rollout.rollout.types import Timeline

SWITCH_KEYS = ("src", "dst", "step", "cause", "bytes_sent", "bytes_received", "overhead_ms",
               "blocking_estimate_ms", "deferred_reason", "blocking")


CURVE_STEP = 0.2
"""A phase's batch_curve gets a point whenever the running batch moved by this fraction of the last point's."""
MEMORY_STEP = 0.05
"""A phase's memory_curve gets a point whenever a fraction moved by this much."""


def memory_fractions(step: StepRecord) -> tuple[float, float]:
    """(used, used + expected growth) of the busiest rank's pool in one step record."""
    used, promised, total = step.pages_used, step.pages_promised, step.pages_total
    if not used or not total:
        return 0.0, 0.0
    return (max(u / t for u, t in zip(used, total)),
            max((u + p) / t for u, p, t in zip(used, promised or [0] * len(used), total)))


def phases_from_steps(steps: list[StepRecord]) -> list[dict[str, Any]]:
    phases: list[dict[str, Any]] = []
    t = 0.0
    for s in steps:
        t_end = t + s.seconds
        if phases and phases[-1]["layout"] == s.layout:
            p = phases[-1]
            p.update(t_end=t_end, steps=p["steps"] + 1, batch_size_end=s.running, tokens=p["tokens"] + s.rows)
        else:
            p = {"layout": s.layout, "t_start": t, "t_end": t_end, "steps": 1, "batch_size_start": s.requests,
                 "batch_size_end": s.running, "tokens": s.rows, "batch_curve": [[t, s.requests]],
                 "memory_curve": [[t, *memory_fractions(s)]], "speculation_spans": []}
            phases.append(p)
        if s.draft_tokens:  # extend the phase's last span of drafted steps, or open one
            spans = p["speculation_spans"]
            if spans and spans[-1][1] == t:
                spans[-1][1] = t_end
            else:
                spans.append([t, t_end])
        last = p["batch_curve"][-1][1]
        if abs(s.running - last) >= CURVE_STEP * max(last, 1):
            p["batch_curve"].append([t_end, s.running])
        mem, mem_last = memory_fractions(s), p["memory_curve"][-1][1:]
        if max(abs(a - b) for a, b in zip(mem, mem_last)) >= MEMORY_STEP:
            p["memory_curve"].append([t_end, *mem])
        p["memory_end"] = list(mem)
        t = t_end
    for p in phases:
        if p["batch_curve"][-1][0] != p["t_end"]:
            p["batch_curve"].append([p["t_end"], p["batch_size_end"]])
        end = p.pop("memory_end")
        if p["memory_curve"][-1][0] != p["t_end"]:
            p["memory_curve"].append([p["t_end"], *end])
    return phases


def build_timeline(steps: list[StepRecord], switches: list[dict[str, Any]],
                   decisions: list[dict[str, Any]] = ()) -> Timeline:
    records = []
    for r in switches:
        rec = {k: r.get(k) for k in SWITCH_KEYS}
        if rec["deferred_reason"] is not None:
            rec.update(bytes_sent=None, bytes_received=None, overhead_ms=None, blocking_estimate_ms=None)
        records.append(rec)
    speculation = [{"step": s.step, **s.speculation} for s in steps if s.speculation]
    return Timeline(phases=phases_from_steps(steps), switches=records, decisions=list(decisions),
                    speculation=speculation)


def layout_metrics(timeline: Timeline) -> dict[str, float]:
    """``layout/*`` records of one call: time share per layout, switches done and deferred, overhead."""
    total = sum(p["t_end"] - p["t_start"] for p in timeline.phases) or 1.0
    out: dict[str, float] = {}
    for p in timeline.phases:
        key = f"layout/time_share/{p['layout']}"
        out[key] = out.get(key, 0.0) + (p["t_end"] - p["t_start"]) / total
    done = [s for s in timeline.switches if s["deferred_reason"] is None]
    out["layout/switches"] = float(len(done))
    out["layout/deferred_switches"] = float(len(timeline.switches) - len(done))
    out["layout/switch_overhead_ms"] = float(sum(s["overhead_ms"] or 0.0 for s in done))
    out["layout/pressure_switches"] = float(sum(s.get("cause") == "pressure" for s in done))
    return out


def memory_metrics(steps: list[StepRecord]) -> dict[str, float]:
    """``rollout/*`` memory records of one call: retractions, prompt KV taken from another sample or
    from the prefix cache instead of computed (and the cache's share of it), prefill rows computed,
    and the busiest rank's peak and mean pool use."""
    used = [memory_fractions(s)[0] for s in steps] or [0.0]
    return {"rollout/retractions": float(sum(s.retracted for s in steps)),
            "rollout/prefix_hit_tokens": float(sum(s.prefix_hit_tokens for s in steps)),
            "rollout/cached_tokens": float(sum(s.cached_tokens for s in steps)),
            "rollout/prefill_rows": float(sum(s.prefill_rows for s in steps)),
            "memory/kv_used_peak": float(max(used)), "memory/kv_used_mean": float(sum(used) / len(used))}


def speculation_metrics(steps: list[StepRecord]) -> dict[str, float]:
    """``spec/*`` of one call: drafted tokens verified, drafted tokens kept, tokens a verified row
    yields (the kept drafts plus the token sampled after them, per verified row) and steps that
    verified any draft; per draft source (``spec/verified/<source>``, ``spec/acceptance_len/<source>``:
    group, history, own, prompt -- where the draft's first token was last seen --, and mtp, the model's
    MTP module); ``spec/accepted_at/<j>``: of the drafts with a token j (1-based) whose earlier tokens
    were all kept, the share whose token j was kept too (the chance a draft goes on at j)."""
    drafted, verified = sum(s.draft_tokens for s in steps), sum(s.verified for s in steps)
    accepted = sum(s.accepted_tokens for s in steps)
    out = {"spec/draft_tokens": float(drafted), "spec/accepted_tokens": float(accepted),
           "spec/acceptance_len": (accepted + verified) / verified if verified else 0.0,
           "spec/steps_on": float(sum(s.draft_tokens > 0 for s in steps))}
    by_position: list[list[int]] = []
    for s in steps:
        for j, (drafted_j, kept_j) in enumerate(s.draft_positions):
            if j == len(by_position):
                by_position.append([0, 0])
            by_position[j][0] += drafted_j
            by_position[j][1] += kept_j
    for j, (drafted_j, kept_j) in enumerate(by_position):
        out[f"spec/accepted_at/{j + 1}"] = kept_j / drafted_j
    for source in DRAFT_SOURCES:
        counts = [s.draft_sources[source] for s in steps if source in s.draft_sources]
        v, kept = sum(c[0] for c in counts), sum(c[2] for c in counts)
        out[f"spec/verified/{source}"] = float(v)
        out[f"spec/acceptance_len/{source}"] = (kept + v) / v if v else 0.0
    return out
