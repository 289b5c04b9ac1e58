"""The layout timeline of rollout calls: per-step ``layout/*`` records, JSON, table rows and a PNG.

Input is what ``Timeline.to_dict()`` returns for one ``generate`` call: ``phases`` (each: layout,
t_start, t_end, steps, tokens, and ``batch_size`` or ``batch_size_start`` / ``batch_size_end``) and
``switches`` (each: src/dst, step, bytes, ``overhead_ms``). Several calls (one per RL step) are laid
end to end on one time axis in the plot.
"""
from __future__ import annotations

import json
import os
from typing import Any, Sequence

LAYOUT_COLORS = {"tp": "#4c72b0", "dp": "#55a868", "dop": "#c44e52", "cp": "#8172b2"}
TABLE_COLUMNS = ("rl_step", "layout", "t_start", "t_end", "engine_steps", "batch_size_start",
                 "batch_size_end", "tokens", "tokens_per_s", "replica")
"""``replica``: the fleet replica that ran the phase (0 for a single engine)."""


def _batch_sizes(phase: dict[str, Any]) -> tuple[int, int]:
    start = phase.get("batch_size_start", phase.get("batch_size", 0))
    return int(start), int(phase.get("batch_size_end", start))


def _switch_overhead_ms(switch: dict[str, Any]) -> float:
    if switch.get("overhead_ms") is not None:
        return float(switch["overhead_ms"])
    return 1e3 * float(switch.get("overhead_s") or 0.0)


def _total_bytes(value: Any) -> float:
    """``bytes_received`` is one number, one entry per rank, or None (a deferred switch)."""
    if value is None:
        return 0.0
    return float(sum(value)) if isinstance(value, (list, tuple)) else float(value)


def layout_metrics(timeline: dict[str, Any]) -> dict[str, float]:
    """``layout/time_share/<layout>`` (fraction of the call's time per layout), ``layout/switches``
    (done), ``layout/deferred_switches``, ``layout/switch_overhead_ms`` (exposed, summed),
    ``layout/switch_bytes`` (received, summed over switches and ranks) and ``layout/pressure_switches``
    (switches the policy made to relieve KV memory pressure)."""
    phases, switches = timeline.get("phases", []), timeline.get("switches", [])
    spans: dict[str, float] = {}
    for p in phases:
        spans[p["layout"]] = spans.get(p["layout"], 0.0) + max(0.0, p["t_end"] - p["t_start"])
    total = sum(spans.values())
    out = {f"layout/time_share/{k}": (v / total if total > 0 else 0.0) for k, v in sorted(spans.items())}
    done = [s for s in switches if s.get("deferred_reason") is None]
    out["layout/switches"] = float(len(done))
    out["layout/deferred_switches"] = float(len(switches) - len(done))
    out["layout/switch_overhead_ms"] = float(sum(_switch_overhead_ms(s) for s in done))
    out["layout/switch_bytes"] = float(sum(_total_bytes(s.get("bytes_received")) for s in done))
    out["layout/pressure_switches"] = float(sum(s.get("cause") == "pressure" for s in done))
    return out


def table_rows(step: int, timeline: dict[str, Any]) -> list[list[Any]]:
    """One row per phase, columns ``TABLE_COLUMNS``."""
    rows = []
    for p in timeline.get("phases", []):
        b0, b1 = _batch_sizes(p)
        dt = p["t_end"] - p["t_start"]
        rows.append([step, p["layout"], round(p["t_start"], 6), round(p["t_end"], 6), int(p.get("steps", 0)),
                     b0, b1, int(p.get("tokens", 0)), (p.get("tokens", 0) / dt if dt > 0 else 0.0),
                     int(p.get("replica", 0))])
    return rows


def write_timeline_json(path: str, timelines: Sequence[tuple[int, dict[str, Any]]]) -> None:
    """``{"steps": [{"step": s, "phases": [...], "switches": [...]}, ...]}``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"steps": [{"step": s, **t} for s, t in timelines]}, f, indent=1)


def plot_timeline(path: str, timelines: Sequence[tuple[int, dict[str, Any]]]) -> str:
    """Layouts as coloured bands over rollout time (calls laid end to end), batch size (left axis) and
    tokens/s (right axis) per phase, switches as dashed lines (red: to relieve memory pressure), the
    steps that verified drafted tokens (speculative decoding) as a hatched strip along the top; below,
    on the same bands, the busiest rank's KV pool in use and in use plus expected growth. Writes a
    PNG; returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, (ax, mem) = plt.subplots(2, 1, figsize=(11, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]})
    ax2 = ax.twinx()
    offset, seen, speculated = 0.0, {}, False
    lanes_seen = 1
    for step, t in timelines:
        phases = t.get("phases", [])
        by_replica: dict[Any, list[dict]] = {}
        for p in phases:  # a fleet's call: each replica's phases in a lane of its own, on the same clock
            by_replica.setdefault(p.get("replica"), []).append(p)
        lanes = sorted(by_replica, key=lambda r: -1 if r is None else r)
        lanes_seen = max(lanes_seen, len(lanes))
        for lane, replica in enumerate(lanes):
            lo, hi = lane / len(lanes), (lane + 1) / len(lanes)
            own = by_replica[replica]
            for p in own:
                x0, x1 = offset + p["t_start"], offset + p["t_end"]
                color = LAYOUT_COLORS.get(p["layout"], "#999999")
                ax.axvspan(x0, x1, ymin=lo, ymax=hi, color=color, alpha=0.25, lw=0)
                mem.axvspan(x0, x1, ymin=lo, ymax=hi, color=color, alpha=0.25, lw=0)
                seen[p["layout"]] = color
                for s0, s1 in p.get("speculation_spans", []):
                    ax.axvspan(offset + s0, offset + s1, ymin=lo + 0.93 * (hi - lo), ymax=hi, facecolor="none",
                               edgecolor="tab:green", hatch="////", lw=0)
                    speculated = True
                if p.get("memory_curve"):
                    xs = [offset + c[0] for c in p["memory_curve"]]
                    mem.plot(xs, [c[1] for c in p["memory_curve"]], color="black", lw=1.2)
                    mem.plot(xs, [c[2] for c in p["memory_curve"]], color="black", lw=0.8, ls=":")
                b0, b1 = _batch_sizes(p)
                curve = p.get("batch_curve") or [[p["t_start"], b0], [p["t_end"], b1]]
                ax.plot([offset + c[0] for c in curve], [c[1] for c in curve], color="black", lw=1.2)
                dt = p["t_end"] - p["t_start"]
                ax2.plot([x0, x1], [p.get("tokens", 0) / dt if dt > 0 else 0.0] * 2, color="tab:orange", lw=1.2)
            done = [s for s in t.get("switches", []) if s.get("deferred_reason") is None
                    and s.get("replica") == replica]
            causes = [s.get("cause") for s in done]
            for i, x in enumerate(offset + p["t_start"] for p in own[1:]):  # a switch starts the next phase
                pressure = i < len(causes) and causes[i] == "pressure"
                for a in (ax, mem):
                    a.axvline(x, ymin=lo, ymax=hi, color="tab:red" if pressure else "gray", ls="--",
                              lw=1.0 if pressure else 0.8)
        end = max((p["t_end"] for p in phases), default=0.0)
        ax.axvline(offset, color="black", lw=0.5, alpha=0.5)
        ax.text(offset, 1.0, f" {step}", transform=ax.get_xaxis_transform(), va="top", fontsize=7)
        offset += end
    mem.set_xlabel("rollout time (s; RL steps laid end to end)"
                   + (f"; bands: one lane per replica, {lanes_seen} replicas" if lanes_seen > 1 else ""))
    mem.set_ylabel("KV pool used")
    mem.set_ylim(0, 1.05)
    mem.legend(handles=[plt.Line2D([], [], color="black", label="in use"),
                        plt.Line2D([], [], color="black", ls=":", label="+ expected growth"),
                        plt.Line2D([], [], color="tab:red", ls="--", label="pressure switch")],
               loc="upper right", fontsize=7)
    ax.set_ylabel("running requests (batch size)")
    ax2.set_ylabel("tokens / s (query rows)", color="tab:orange")
    handles = [Patch(color=c, alpha=0.4, label=k) for k, c in seen.items()]
    handles += [plt.Line2D([], [], color="black", label="batch size"),
                plt.Line2D([], [], color="tab:orange", label="tokens/s")]
    if speculated:
        handles.append(Patch(facecolor="none", edgecolor="tab:green", hatch="////", label="speculating"))
    ax.legend(handles=handles, loc="upper right", fontsize=8)
    ax.set_title("layout timeline")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
