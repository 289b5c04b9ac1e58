"""The published fixed-layout sweeps on the cost model: predict, fit θ to a subset, report regret.

A measured point is B requests of L_in prompt tokens, 1,024 output tokens each, served by a prefill
group in the layout under test and a decode group in DP-attention (``Serving``); throughput is
B (L_in + 1024) / T_batch. The model of T_batch:

    T_batch = prefill steps (chunked, in the layout, priced by step_time)
            + the last prompt's KV transfer (from the ranks that hold it: CP's 8 slices at once)
            + decode of the last wave (1,024 steps on the decode group)
            + per-layout fixed costs per prefill step and per prefill token
            + a per-layout fixed cost per batch

Prefill is chunked as the engine does: TP / CP run ``chunk_tokens`` rows of the group's FCFS queue
per step; DP-attention / DOP give each owner ``chunk_tokens / T`` rows of its own requests (owners
round-robin), owners stepping together, so few requests leave owners idle. Decode overlaps the
prefill of later prompts, so only the last wave's decode is exposed; waves are counted when the
decode group's pools cannot hold the batch.

T_batch is linear in the fitted constants once the roofline seconds are known: the stage seconds
of every step (compute, attention, comm), the decode seconds, the bytes one sending rank transfers,
the step, request and token counts. ``base_features`` computes those once per point from the
unfitted θ; ``fit`` solves a nonnegative least squares on relative error, with a weak prior pulling
the stage scales to 1 and an ordering term that charges a layout predicted ahead of the measured
leader (``solve_constants``). The policy uses the model to choose, and least squares alone is blind
to order: with every error within 25 % the model's constants can reproduce 31 of the 32 B200
leaders, yet the least-squares fit reproduced 17.

A per-request constant per layout (``layout_request_s``) is a term of the model (a profile that
carries one is priced with it) but the default fit leaves it out: across the 1K / 4K rows the
layouts' extra seconds do not grow with the request count (DP-attention takes 26.3 s at 4K for
B = 16 and for B = 32), and a per-request constant fitted on the long rows mispriced them
(``docs/results/paper_fit.md``); a per-layout constant per batch fits them.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from importlib import resources
from typing import Iterable, Mapping, Sequence

import numpy as np

from splash_rollout.layout import ALL_LAYOUTS, Layout
from splash_rollout.scheduling import StepBatch, step_time
from splash_rollout.scheduling.deployment import Deployment, Serving, kv_senders
from splash_rollout.scheduling.numeric_fit import nnls, nnls_hinge
from splash_rollout.scheduling.platforms import build_serving, spec_serving
from splash_rollout.scheduling.profile import STAGE_GROUPS

OUTPUT_TOKENS = 1024
SAMPLED_CHUNKS = 9
"""Chunk positions priced per prompt (the rest interpolated: step cost is smooth in the start)."""
PLATFORM_KEYS = {"b200": "B200", "dcu": "DCU", "h200": "H200"}
LAYOUT_NAMES = tuple(l.value for l in ALL_LAYOUTS)
SCALE_PRIOR = 0.05
"""Weight of the prior that pulls each stage scale toward 1 (relative to a point's unit error)."""
RANK_WEIGHT = 1.0
"""Weight of the ordering term of the fit (``solve_constants``): 1 prices a layout predicted ahead of
the measured leader by x like a relative error x; 0 is plain least squares."""


@dataclass(frozen=True)
class Point:
    sweep: str
    input_tokens: int
    batch: int
    measured: Mapping[str, float]
    """Per layout: throughput in 10^3 tokens/s."""

    @property
    def tokens(self) -> int:
        return self.batch * (self.input_tokens + OUTPUT_TOKENS)


def paper_data() -> dict:
    return json.loads(resources.files("splash_rollout.sim").joinpath("paper_points.json").read_text())


def points(platform: str, sweeps: Iterable[str] | None = None) -> list[Point]:
    """The measured points of ``platform``'s ``sweeps`` (all when None), in table order."""
    data = paper_data()[_key(platform)]["sweeps"]
    names = list(data) if sweeps is None else list(sweeps)
    bad = [s for s in names if s not in data]
    if bad:
        raise ValueError(f"--train: unknown sweep {bad[0]!r} for {platform}; expected names from {sorted(data)}")
    return [Point(s, int(r[0]), int(r[1]), dict(zip(LAYOUT_NAMES, map(float, (r[2], r[3], r[4], r[5])))))
            for s in names for r in data[s]]


def sweep_names(platform: str) -> list[str]:
    return list(paper_data()[_key(platform)]["sweeps"])


def published_pools(platform: str) -> dict[str, int]:
    """Per-rank KV pool tokens per layout the authors' engine allocated (Table 3; for H200 with
    DeepSeek-V3.2, their projection of it)."""
    pools = paper_data()["pools"]
    if platform == "h200":
        return {k: int(v) for k, v in pools["H200_deepseek_v32_per_gpu"].items() if k != "_about"}
    rows = pools[_key(platform)]
    return {k: int(v[2]) if k == "tp" else int(v[2]) // 8 for k, v in rows.items() if k != "_about"}


def _key(platform: str) -> str:
    if platform.lower() not in PLATFORM_KEYS:
        raise ValueError(f"--platform: expected one of {sorted(PLATFORM_KEYS)}, got {platform!r}")
    return PLATFORM_KEYS[platform.lower()]


def base_serving(platform: str) -> Serving:
    """Spec θ with the published pools: where a fit starts."""
    return spec_serving(platform, published_pools(platform))


# ---- features: T_batch as a linear function of the fitted constants ---------------------------------

BASE = (*STAGE_GROUPS, "overhead", "steps", "requests", "tokens", "decode", "transfer_bytes", "batch")
"""Per (point, layout): stage seconds at unit scale, the base overhead seconds, prefill steps,
requests, prefill tokens, decode seconds, the last prompt's KV bytes per sending rank, and 1 (the
batch)."""
PER_LAYOUT_DEFAULT = ("attention", "comm", "steps", "tokens", "batch")
"""Which BASE terms get one constant per layout in the fit (the others one shared constant)."""
FITTED_DEFAULT = tuple(b for b in BASE if b != "requests")
"""Which BASE terms the fit gives a constant (the others are left out: 0, and 1 for ``overhead``)."""


def _unit(dep: Deployment) -> Deployment:
    prof = dep.profile.replace(stage_scale={}, layout_step_s={}, layout_request_s={}, layout_token_s={})
    return replace(dep, profile=prof)


def _step_groups(dep: Deployment, layout: Layout, batch: StepBatch) -> np.ndarray:
    """[compute, attention, comm, overhead] seconds of one step at unit scales."""
    st = step_time(layout, batch, dep.model, dep.profile, dep.sizes).stages
    return np.array([st["attn_in"] + st["attn_proj"] + st["mlp"] + st["lm_head"], st["attention"] + st["indexer"],
                     st["attn_comm"] + st["mlp_comm"], st["overhead"]])


def prefill_features(dep: Deployment, layout: Layout, length: int, batch: int) -> tuple[np.ndarray, int]:
    """Stage seconds [compute, attention, comm, overhead] summed over the prefill of ``batch``
    prompts of ``length`` tokens in ``layout`` at unit scales, and the number of steps."""
    t = dep.world_size
    chunk = dep.chunk_tokens(layout, 16384)
    if layout in (Layout.DP, Layout.DOP):
        lanes = np.bincount(np.arange(batch) % t, minlength=t)  # requests per owner
        budget = max(chunk // t, 1)
    else:
        lanes = np.array([batch])
        budget = chunk
    total, steps = np.zeros(4), 0
    if length >= budget:
        per = -(-length // budget)  # chunks per prompt
        prev = 0
        for level in sorted(set(lanes[lanes > 0].tolist())):
            rounds, prev = level - prev, level  # rounds in which the lanes holding >= level requests work
            active = int((lanes >= level).sum())
            js = np.unique(np.linspace(0, per - 1, min(per, SAMPLED_CHUNKS)).round().astype(int))
            costs = []
            for j in js:
                q = min(budget, length - j * budget)
                b = StepBatch.make([j * budget + q] * active, [q] * active, np.arange(active) % t,
                                   sampling_rows=active if j == per - 1 else 0)
                costs.append(_step_groups(dep, layout, b))
            costs = np.array(costs)  # [len(js), 4]
            total += rounds * np.array([np.interp(np.arange(per), js, costs[:, g]).sum() for g in range(4)])
            steps += rounds * per
    else:
        per_step = max(budget // length, 1)  # whole prompts one lane prefills per step
        counts = lanes.copy()
        cache: dict[tuple, np.ndarray] = {}
        while counts.sum() > 0:
            now = np.minimum(counts, per_step)
            key = tuple(now.tolist())
            if key not in cache:
                n = int(now.sum())
                b = StepBatch.make([length] * n, [length] * n, np.repeat(np.arange(now.size), now) % t, sampling_rows=n)
                cache[key] = _step_groups(dep, layout, b)
            total += cache[key]
            steps += 1
            counts = counts - now
    return total, steps


def decode_seconds(dec: Deployment, length: int, batch: int) -> float:
    """Seconds of the exposed decode: 1,024 steps of the last wave on the decode group (DP-attention,
    round-robin owners), Simpson over the context; earlier waves (when the pools cannot hold the
    batch) counted whole."""
    t = dec.world_size
    cap = max(int(dec.pools[Layout.DP] // (length + OUTPUT_TOKENS)) * t, 1)
    waves = -(-batch // cap)
    last = batch - (waves - 1) * cap

    def wave(b: int) -> float:
        s = [step_time(Layout.DP, StepBatch.make([length + k] * b, 1, np.arange(b) % t), dec.model, dec.profile,
                       dec.sizes).seconds for k in (1, OUTPUT_TOKENS // 2, OUTPUT_TOKENS)]
        return OUTPUT_TOKENS * (s[0] + 4 * s[1] + s[2]) / 6
    return wave(last) + (waves - 1) * wave(cap)


def base_features(serving: Serving, pt: Point, layout: Layout) -> np.ndarray:
    """[len(BASE)] terms of ``pt`` in ``layout``."""
    pre = _unit(serving.prefill)
    stages, steps = prefill_features(pre, layout, pt.input_tokens, pt.batch)
    dec = decode_seconds(serving.decode, pt.input_tokens, pt.batch) if serving.decode is not None else 0.0
    xfer = (pt.input_tokens * pre.sizes.kv_bytes_per_token_total / kv_senders(layout, pre.world_size)
            if serving.decode is not None else 0.0)
    return np.array([*stages, steps, pt.batch, pt.batch * pt.input_tokens, dec, xfer, 1.0])


def columns(per_layout: Sequence[str] = PER_LAYOUT_DEFAULT, terms: Sequence[str] = FITTED_DEFAULT) -> tuple[str, ...]:
    """Names of the constants of ``terms`` (BASE names, in BASE order): ``TERM`` (shared) or
    ``TERM/LAYOUT`` for the terms in ``per_layout``."""
    out = []
    for b in BASE:
        if b in terms:
            out += [f"{b}/{l}" for l in LAYOUT_NAMES] if b in per_layout else [b]
    return tuple(out)


def design(base: np.ndarray, cols: Sequence[str]) -> np.ndarray:
    """[P, 4, len(cols)] from a [P, 4, len(BASE)] table: a per-layout column holds its term only in
    that layout's rows."""
    out = np.zeros(base.shape[:2] + (len(cols),))
    for k, c in enumerate(cols):
        term, _, lay = c.partition("/")
        v = base[:, :, BASE.index(term)]
        out[:, :, k] = v if not lay else np.where(np.arange(4)[None, :] == LAYOUT_NAMES.index(lay), v, 0.0)
    return out


def coefficients(serving: Serving, cols: Sequence[str]) -> np.ndarray:
    """[len(cols)] the constants of ``serving`` that multiply each column (a shared column takes the
    layout-free value)."""
    p = serving.prefill.profile
    out = []
    for c in cols:
        term, _, lay = c.partition("/")
        if term in STAGE_GROUPS:
            out.append(p.scale(term, lay))
        elif term == "overhead":
            out.append(1.0)
        elif term == "steps":
            out.append(p.per_layout("layout_step_s", lay))
        elif term == "requests":
            out.append(p.per_layout("layout_request_s", lay))
        elif term == "tokens":
            out.append(p.per_layout("layout_token_s", lay))
        elif term == "decode":
            out.append(serving.decode_scale)
        elif term == "transfer_bytes":
            out.append(1.0 / serving.kv_transfer_Bps if serving.kv_transfer_Bps > 0 else 0.0)
        elif lay:
            out.append(serving.batch_seconds(lay))
        else:
            shared = set(serving.batch_overhead_s.get(l, 0.0) for l in LAYOUT_NAMES)
            if len(shared) != 1:
                raise ValueError(f"batch: a shared column needs one batch constant, got {serving.batch_overhead_s}")
            out.append(shared.pop())
    return np.array(out)


def with_coefficients(serving: Serving, cols: Sequence[str], coef: Sequence[float]) -> Serving:
    """``serving`` with the fitted constants (per-layout stage scales as ``GROUP/LAYOUT`` keys); a
    profile term without a column is 0 (a stage scale 1), a serving one keeps its value."""
    scale, step_s, req_s, tok_s, batch_s, c = {}, {}, {}, {}, {}, {}
    for name, v in zip(cols, map(float, coef)):
        term, _, lay = name.partition("/")
        if term in STAGE_GROUPS:
            scale[name] = v
        elif term == "steps":
            step_s.update({lay: v} if lay else {l: v for l in LAYOUT_NAMES})
        elif term == "requests":
            req_s.update({lay: v} if lay else {l: v for l in LAYOUT_NAMES})
        elif term == "tokens":
            tok_s.update({lay: v} if lay else {l: v for l in LAYOUT_NAMES})
        elif term == "batch":
            batch_s.update({lay: v} if lay else {l: v for l in LAYOUT_NAMES})
        else:
            c[term] = v
    p = serving.prefill.profile.replace(stage_scale=scale, layout_step_s=step_s, layout_request_s=req_s,
                                              layout_token_s=tok_s)
    dec = serving.decode
    rate = 1.0 / c["transfer_bytes"] if c.get("transfer_bytes", 0) > 0 else 1e15
    return build_serving(serving.prefill.model, p, None if dec is None else dec.world_size,
                         rate if dec is not None else 0.0, c.get("decode", serving.decode_scale),
                         batch_s or serving.batch_overhead_s)


def feature_table(serving: Serving, pts: Sequence[Point]) -> np.ndarray:
    """[P, 4 layouts, len(BASE)]."""
    return np.array([[base_features(serving, pt, l) for l in ALL_LAYOUTS] for pt in pts])


def predict(serving: Serving, pts: Sequence[Point], table: np.ndarray | None = None) -> np.ndarray:
    """[P, 4] predicted throughput (10^3 tokens/s) per point and layout."""
    table = feature_table(serving, pts) if table is None else table
    cols = columns(LAYOUT_TERMS, BASE)
    seconds = design(table, cols) @ coefficients(serving, cols)
    tokens = np.array([pt.tokens for pt in pts], dtype=np.float64)[:, None]
    return tokens / seconds / 1e3


LAYOUT_TERMS = BASE
"""Prediction reads every constant per layout (a shared one is the same for each)."""
PRIOR = {"compute": 1.0, "attention": 1.0, "comm": 1.0, "decode": 1.0}
"""Prior value of the fitted scales; the fit pulls each toward it with weight SCALE_PRIOR."""


def measured_seconds(pts: Sequence[Point]) -> np.ndarray:
    """[P, 4] measured T_batch per point and layout (seconds), from the published throughput."""
    return np.array([[pt.tokens / (pt.measured[l] * 1e3) for l in LAYOUT_NAMES] for pt in pts])


def fit(serving: Serving, pts: Sequence[Point], table: np.ndarray | None = None,
        per_layout: Sequence[str] = PER_LAYOUT_DEFAULT, prior_weight: float = SCALE_PRIOR,
        terms: Sequence[str] = FITTED_DEFAULT, rank_weight: float = RANK_WEIGHT) -> tuple[Serving, dict]:
    """Constants of ``serving`` for ``terms`` fitted to ``pts`` (all four layouts of each) by
    ``solve_constants``. ``table``: [P, 4, len(BASE)] from ``feature_table`` (computed when None)."""
    if not pts:
        raise ValueError("--train: expected at least one sweep with points")
    table = feature_table(serving, pts) if table is None else table
    cols = columns(per_layout, terms)
    measured_s = measured_seconds(pts)
    fixed = {"overhead": 1.0}
    if serving.decode is None:
        fixed.update(decode=0.0, transfer_bytes=0.0)
    coef, rounds = solve_constants(design(table, cols), cols, measured_s, fixed, prior_weight, rank_weight)
    fitted = with_coefficients(serving, cols, coef)
    pred = predict(fitted, pts, table)
    meas = np.array([[pt.measured[l] for l in LAYOUT_NAMES] for pt in pts])
    err = np.abs(pred / meas - 1.0)
    wrong = int((pred.argmax(axis=1) != meas.argmax(axis=1)).sum())
    return fitted, {"train_points": len(pts), "median_abs_error": float(np.median(err)),
                    "max_abs_error": float(err.max()), "train_leaders_missed": wrong, "rank_weight": rank_weight,
                    "hinge_rounds": rounds, "constants": dict(zip(cols, map(float, coef)))}


def solve_constants(d: np.ndarray, cols: Sequence[str], measured_s: np.ndarray, fixed: Mapping[str, float],
                    prior_weight: float = SCALE_PRIOR, rank_weight: float = RANK_WEIGHT,
                    data_weights: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """[C] constants for the design ``d`` ([P, 4, C] seconds per unit constant, from ``design``) and
    the measured seconds ``measured_s`` ([P, 4]); the columns named in ``fixed`` keep their value.

    Objective, all in relative units of each point's measured seconds T:
      Σ_(p, l) (T̂_pl / T_pl - 1)²                         every layout's error
    + (prior_weight² · 4P) Σ_scales (scale - PRIOR)²          stage scales pulled toward 1
    + rank_weight Σ_p Σ_(l ≠ b_p) max(0, (T̂_pb - T̂_pl) / T_pb)²
    where b_p is the layout measured fastest at p: the last term charges a predicted ordering that
    puts another layout ahead of the measured leader by as much as the same relative error would
    cost, and nothing once the leader is ahead (a choice needs the order, not the gap). Solved by
    ``nnls_hinge``; also returns its rounds (0 without the ordering term). ``data_weights`` ([P, 4],
    default 1) scales each error term's residual (a robust loss reweights them)."""
    w_data = np.ones(d.shape[:2]) if data_weights is None else np.asarray(data_weights, dtype=np.float64)
    a = (d / measured_s[:, :, None]).reshape(-1, len(cols))
    b = np.ones(a.shape[0])
    offset = np.zeros(d.shape[:2])  # [P, 4] seconds of the fixed columns
    for k, c in enumerate(cols):
        if c in fixed:
            b = b - a[:, k] * fixed[c]
            offset += d[:, :, k] * fixed[c]
    free = [k for k, c in enumerate(cols) if c not in fixed]
    size = np.maximum(np.abs(a[:, free]).max(axis=0), 1e-300)  # fit in O(1) units: z = coef * size
    rows, rhs = [a[:, free] / size * w_data.reshape(-1, 1)], [b * w_data.reshape(-1)]
    weight = prior_weight * math.sqrt(len(b))
    for j, k in enumerate(free):
        term = cols[k].partition("/")[0]
        if term in PRIOR:
            r = np.zeros((1, len(free)))
            r[0, j] = weight / size[j]
            rows.append(r)
            rhs.append(np.array([weight * PRIOR[term]]))
    a_all, b_all = np.vstack(rows), np.concatenate(rhs)
    if rank_weight > 0:
        leader = measured_s.argmin(axis=1)
        others = np.ones(d.shape[:2], dtype=bool)
        others[np.arange(d.shape[0]), leader] = False
        pi, li = np.nonzero(others)  # every (point, layout) pair but the measured leader
        bi, tb = leader[pi], measured_s[pi, leader[pi]]
        scale = math.sqrt(rank_weight) / tb
        g = (d[pi, bi][:, free] - d[pi, li][:, free]) * scale[:, None] / size
        c = -(offset[pi, bi] - offset[pi, li]) * scale
        z, rounds = nnls_hinge(a_all, b_all, g, c)
    else:
        z, rounds = nnls(a_all, b_all), 0
    coef = np.array([fixed.get(c, 0.0) for c in cols])
    coef[free] = z / size
    return coef, rounds


def report(serving: Serving, pts: Sequence[Point], table: np.ndarray | None = None) -> dict:
    """Per point: predicted and measured throughput per layout, the chosen layout (fastest
    predicted), its regret against the measured best; and the summary."""
    pred = predict(serving, pts, table)
    rows, regrets, exact = [], [], 0
    errors = {l: [] for l in LAYOUT_NAMES}
    cp_regret = []
    for pt, pr in zip(pts, pred):
        meas = pt.measured
        chosen = LAYOUT_NAMES[int(np.argmax(pr))]
        best = max(meas, key=meas.get)
        regret = 1.0 - meas[chosen] / meas[best]
        regrets.append(regret)
        cp_regret.append(1.0 - meas["cp"] / meas[best])
        exact += chosen == best
        for i, l in enumerate(LAYOUT_NAMES):
            errors[l].append(abs(pr[i] / meas[l] - 1.0))
        rows.append({"sweep": pt.sweep, "input_tokens": pt.input_tokens, "B": pt.batch,
                     "predicted": {l: round(float(pr[i]), 4) for i, l in enumerate(LAYOUT_NAMES)},
                     "measured": dict(meas), "chosen": chosen, "best": best, "regret": round(float(regret), 5)})
    constant = {l: float(np.mean([1.0 - pt.measured[l] / max(pt.measured.values()) for pt in pts]))
                for l in LAYOUT_NAMES}
    return {"points": rows, "summary": {
        "points": len(pts), "mean_regret": float(np.mean(regrets)), "max_regret": float(np.max(regrets)),
        "exact_leaders": int(exact), "median_abs_error": {l: float(np.median(v)) for l, v in errors.items()},
        "best_constant": min(constant, key=constant.get), "best_constant_mean_regret": min(constant.values()),
        "constant_mean_regret": constant}}
