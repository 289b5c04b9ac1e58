"""Held-out ablations of the published-sweep fit: which extra terms or structures would move the targets.

`sim fit` / `sim paper` run one model. This script runs the same held-out protocol (fit on two
sweeps, evaluate on the other two, and the swap) for variants of that model that the serving
model does not carry -- extra columns, dropped or shared constants, a robust loss -- so a term is
judged by numbers before it is added to `splash_rollout/sim/paper.py`. It rebuilds the fit on the
design matrix of `paper.py` (the same solver, `paper.solve_constants`: relative-error NNLS, the
prior on the stage scales, the ordering term at each variant's weight); the `default` variant
reproduces `sim fit` + `sim paper` exactly (checked at start).

    PYTHONPATH=. python docs/results/paper_fit/ablations.py --platform b200 --json docs/results/paper_fit/b200_ablations.json
"""
from __future__ import annotations

import argparse
import json
from typing import Callable, Sequence

import numpy as np

from splash_rollout.layout import ALL_LAYOUTS, Layout
from splash_rollout.scheduling.deployment import kv_senders
from splash_rollout.sim import paper

HALVES = {"b200": (["B16_in", "64K_bs"], ["B32_in", "128K_bs"]),
          "dcu": (["B16_in", "32K_bs"], ["B32_in", "64K_bs"]),
          "h200": (["B16_in", "32K_bs"], ["B32_in", "64K_bs"])}
SOFT_L1_SCALE = 0.1
"""Relative-error scale of the robust variant (the CPU engine fit's soft-L1 scale)."""


def prefill_capacity(serving, layout: Layout, length: int) -> int:
    """Prompts of ``length`` tokens the prefill group's pool holds at once: TP / CP one pool over the
    group, DP-attention / DOP each owner its own share (a prompt cannot use another owner's room)."""
    dep = serving.prefill
    distinct, t = dep.footprints[layout].distinct_tokens, dep.world_size
    if layout in (Layout.DP, Layout.DOP):
        return t * ((distinct // t) // length)
    return distinct // length


def waiting_requests(serving, pt: paper.Point, layout: Layout) -> float:
    """Requests of the batch beyond what the prefill pool holds (they wait for a finished prompt to leave)."""
    return float(max(pt.batch - prefill_capacity(serving, layout, pt.input_tokens), 0))


def queued_request_steps(serving, pt: paper.Point, layout: Layout) -> float:
    """Requests waiting in the busiest scheduler's queue, summed over the prefill steps: TP / CP run
    one scheduler over the whole batch (FCFS, ``chunk_tokens`` rows a step), DP-attention / DOP one
    per owner holding its round-robin share (``chunk_tokens / T`` rows a step); a prompt leaves the
    queue on the step its prefill starts."""
    dep = serving.prefill
    t, chunk = dep.world_size, dep.chunk_tokens(layout, 16384)
    n, budget = (-(-pt.batch // t), max(chunk // t, 1)) if layout in (Layout.DP, Layout.DOP) else (pt.batch, chunk)
    if pt.input_tokens >= budget:
        return float(-(-pt.input_tokens // budget) * n * (n - 1) // 2)
    per_step = budget // pt.input_tokens
    return float(sum(max(n - per_step * (s + 1), 0) for s in range(-(-n // per_step))))


PREVIOUS_PER_LAYOUT = ("attention", "comm", "steps", "requests", "tokens")
"""The per-layout terms of the model shipped before the per-layout batch constant."""


class Variant:
    """One model: which BASE terms are fitted and which of them per layout, whether CP's last prompt
    leaves its 8 ranks at once (the shipped model) or one rank, extra columns, the loss."""

    def __init__(self, name: str, per_layout: Sequence[str] = paper.PER_LAYOUT_DEFAULT,
                 terms: Sequence[str] = paper.FITTED_DEFAULT, extra: Callable | None = None,
                 extra_per_layout: bool = False, senders: bool = True, robust: bool = False,
                 prior_weight: float = paper.SCALE_PRIOR, rank_weight: float = paper.RANK_WEIGHT, note: str = ""):
        self.name, self.per_layout, self.terms, self.extra = name, tuple(per_layout), tuple(terms), extra
        self.extra_per_layout, self.senders, self.robust, self.note = extra_per_layout, senders, robust, note
        self.prior_weight, self.rank_weight = prior_weight, rank_weight

    def design(self, serving, pts: Sequence[paper.Point], table: np.ndarray) -> tuple[np.ndarray, list[str]]:
        """[P, 4, C] design matrix and its C column names."""
        table = table.copy()
        if not self.senders:  # the table holds bytes per sending rank; one sender carries the whole prompt
            k = paper.BASE.index("transfer_bytes")
            t = serving.prefill.world_size
            table[:, :, k] *= np.array([kv_senders(l, t) for l in ALL_LAYOUTS])[None, :]
        cols = list(paper.columns(self.per_layout, self.terms))
        d = paper.design(table, cols)
        if self.extra is None:
            return d, cols
        e = np.array([[self.extra(serving, pt, l) for l in ALL_LAYOUTS] for pt in pts])  # [P, 4]
        if self.extra_per_layout:
            add = np.stack([np.where(np.arange(4)[None, :] == k, e, 0.0) for k in range(4)], axis=-1)
            return np.concatenate([d, add], axis=-1), cols + [f"extra/{l}" for l in paper.LAYOUT_NAMES]
        return np.concatenate([d, e[..., None]], axis=-1), cols + ["extra"]


def fit_columns(d: np.ndarray, cols: Sequence[str], pts: Sequence[paper.Point], robust: bool,
                prior_weight: float = paper.SCALE_PRIOR, rank_weight: float = paper.RANK_WEIGHT) -> np.ndarray:
    """[C] constants by ``paper.solve_constants`` (relative-error least squares, the stage scales pulled
    toward 1, the ordering term at ``rank_weight``); ``robust``: soft-L1 on the error terms by
    iteratively reweighting them."""
    measured_s = paper.measured_seconds(pts)
    fixed = {"overhead": 1.0}
    coef = paper.solve_constants(d, cols, measured_s, fixed, prior_weight, rank_weight)[0]
    for _ in range(30 if robust else 0):
        residual = d @ coef / measured_s - 1.0
        weights = (1.0 + (residual / SOFT_L1_SCALE) ** 2) ** -0.25
        coef = paper.solve_constants(d, cols, measured_s, fixed, prior_weight, rank_weight, weights)[0]
    return coef


def summary(pred: np.ndarray, pts: Sequence[paper.Point]) -> dict:
    meas = np.array([[pt.measured[l] for l in paper.LAYOUT_NAMES] for pt in pts])  # [P, 4]
    chosen = pred.argmax(axis=1)
    regret = 1.0 - meas[np.arange(len(pts)), chosen] / meas.max(axis=1)
    err = np.median(np.abs(pred / meas - 1.0), axis=0)
    return {"mean_regret": float(regret.mean()), "max_regret": float(regret.max()),
            "worst_point": f"{pts[int(regret.argmax())].input_tokens}/B={pts[int(regret.argmax())].batch}",
            "exact_leaders": int((chosen == meas.argmax(axis=1)).sum()), "points": len(pts),
            "median_abs_error": dict(zip(paper.LAYOUT_NAMES, map(float, err)))}


def run(platform: str, variants: Sequence[Variant]) -> dict:
    base = paper.base_serving(platform)
    first, second = HALVES[platform]
    data = {}
    for h in (first, second):
        pts = paper.points(platform, h)
        data[tuple(h)] = (pts, paper.feature_table(base, pts))
    out = {}
    for v in variants:
        halves = []
        for train, test in ((first, second), (second, first)):
            (ptr, ttr), (pte, tte) = data[tuple(train)], data[tuple(test)]
            dtr, cols = v.design(base, ptr, ttr)
            dte, _ = v.design(base, pte, tte)
            coef = fit_columns(dtr, cols, ptr, v.robust, v.prior_weight, v.rank_weight)
            pred = np.array([pt.tokens for pt in pte], dtype=np.float64)[:, None] / (dte @ coef) / 1e3
            halves.append({"train": "+".join(train), **summary(pred, pte),
                           "constants": {c: float(x) for c, x in zip(cols, coef) if x}})
        out[v.name] = {"note": v.note, "halves": halves,
                       "exact_leaders_both": sum(h["exact_leaders"] for h in halves),
                       "points_both": sum(h["points"] for h in halves)}
    return out


POOL_WAIT = lambda s, pt, l: waiting_requests(s, pt, l) * pt.input_tokens * s.prefill.sizes.kv_bytes_per_token_total
"""Seconds-per-byte column: each request beyond the prefill pool waits one prompt's KV transfer."""
NO_REQUESTS = paper.FITTED_DEFAULT
WITH_REQUESTS = paper.BASE

LS = 0.0
"""The ordering term's weight in the variants of the earlier rounds: relative-error least squares."""

VARIANTS = (
    Variant("default", note="the shipped model (sim fit / sim paper): per-layout batch constant, no per-request "
            "constants, CP's last prompt sent by its 8 ranks, the ordering term at weight 1"),
    Variant("least_squares", rank_weight=LS, note="the shipped model fitted by least squares alone (the model "
            "shipped before the ordering term)"),
    Variant("rank_weight_3", rank_weight=3.0, note="the shipped model, ordering term at weight 3"),
    Variant("rank_weight_10", rank_weight=10.0, note="the shipped model, ordering term at weight 10"),
    Variant("rank_weight_100", rank_weight=100.0, note="the shipped model, ordering term at weight 100"),
    Variant("default+request_cost", per_layout=(*paper.PER_LAYOUT_DEFAULT, "requests"), terms=WITH_REQUESTS,
            note="the shipped model keeping the per-layout per-request constants, ordering term at weight 1"),
    Variant("previous_default", per_layout=PREVIOUS_PER_LAYOUT, terms=WITH_REQUESTS, senders=False, rank_weight=LS,
            note="the model shipped two rounds before: per-layout per-request constants, one batch constant, one "
            "KV sender, least squares"),
    Variant("pool_wait_transfer", per_layout=PREVIOUS_PER_LAYOUT, terms=WITH_REQUESTS, senders=False,
            extra=POOL_WAIT, rank_weight=LS,
            note="previous + a shared s/byte column for the requests beyond the prefill pool"),
    Variant("pool_wait_per_layout", per_layout=PREVIOUS_PER_LAYOUT, terms=WITH_REQUESTS, senders=False,
            extra=waiting_requests, extra_per_layout=True, rank_weight=LS,
            note="previous + free seconds per waiting request per layout (an upper bound on what the pool term can do)"),
    Variant("robust_soft_l1", per_layout=PREVIOUS_PER_LAYOUT, terms=WITH_REQUESTS, senders=False, robust=True,
            rank_weight=LS, note="previous, soft-L1 loss on relative error, scale 0.1"),
    Variant("no_request_cost", per_layout=PREVIOUS_PER_LAYOUT, terms=NO_REQUESTS, senders=False, rank_weight=LS,
            note="previous without its per-request constants"),
    Variant("shared_step_cost", per_layout=("attention", "comm", "requests", "tokens"), terms=WITH_REQUESTS,
            senders=False, rank_weight=LS, note="previous with one per-step constant for all layouts"),
    Variant("ls_one_sender", senders=False, rank_weight=LS,
            note="least squares, one KV sender for every layout"),
    Variant("cp_senders", per_layout=PREVIOUS_PER_LAYOUT, terms=WITH_REQUESTS, rank_weight=LS,
            note="previous with CP's KV sent by 8 ranks"),
    Variant("ls+pool_wait", extra=POOL_WAIT, rank_weight=LS, note="least squares + the shared pool-wait column"),
    Variant("ls+queue_scan", extra=queued_request_steps, rank_weight=LS,
            note="least squares + one shared cost per queued request per prefill step (each scheduler walks "
            "its waiting queue every step; TP / CP hold the whole batch in one queue, an owner its share)"),
    Variant("ls+layout_transfer", per_layout=(*paper.PER_LAYOUT_DEFAULT, "transfer_bytes"), rank_weight=LS,
            note="least squares with one transfer rate per layout (each layout's senders reach their own "
            "rate: one NIC for TP and the owners, CP's 8 slices through the same switch to the same receiver)"),
    Variant("ls_prior_0", prior_weight=0.0, rank_weight=LS, note="least squares without the prior on the stage "
            "scales (0.01 gives the same row)"),
    Variant("ls_prior_0.2", prior_weight=0.2, rank_weight=LS, note="least squares with a 4x stronger prior (1.0 "
            "gives the same row)"),
    Variant("ls+request_cost", per_layout=(*paper.PER_LAYOUT_DEFAULT, "requests"), terms=WITH_REQUESTS,
            rank_weight=LS, note="least squares keeping the per-layout per-request constants"),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--platform", default="b200", choices=sorted(HALVES))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result = run(args.platform, VARIANTS)
    shipped = [paper.report(paper.fit(paper.base_serving(args.platform), paper.points(args.platform, tr))[0],
                            paper.points(args.platform, te))["summary"]
               for tr, te in (HALVES[args.platform], HALVES[args.platform][::-1])]
    for got, want in zip(result["default"]["halves"], shipped):
        if abs(got["mean_regret"] - want["mean_regret"]) > 1e-9 or got["exact_leaders"] != want["exact_leaders"]:
            raise RuntimeError("ablations: the default variant does not reproduce paper.fit; the script is stale")
    for name, r in result.items():
        cells = [f"mean {h['mean_regret']:.2%} max {h['max_regret']:.2%} ({h['worst_point']}) exact "
                 f"{h['exact_leaders']}/{h['points']} err " + "/".join(f"{e:.1%}" for e in h["median_abs_error"].values())
                 for h in r["halves"]]
        print(f"{name:30s} {r['exact_leaders_both']:2d}/{r['points_both']} | " + " | ".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"platform": args.platform, "variants": result}, f, indent=1)


if __name__ == "__main__":
    main()
