"""How many measured leaders the serving model's structure can reproduce at all.

`sim fit` picks the constants by an objective; this asks what the best constants could do. The
model's T_batch is linear in its constants (`paper.design`), so "the measured leader of point p is
predicted fastest" is a set of linear inequalities in them, and the largest set of points whose
leaders one nonnegative choice of constants reproduces is a small mixed-integer program (one binary
per point, big-M on its inequalities), solved with scipy's HiGHS. ``--max-error E`` also asks every
layout's predicted T_batch of every point to be within E of the measured one.

    PYTHONPATH=. python docs/results/paper_fit/leader_bound.py --platform b200 --max-error 0.25

It prints, per sweep set (each held-out half, then all sweeps), the most leaders reproducible and
the points left out. A held-out count can be no higher than the bound of its evaluation half.
"""
from __future__ import annotations

import argparse
import json

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from ablations import HALVES  # the held-out halves, from the script beside this one
from splash_rollout.sim import paper

LEAD = 1e-3
"""A reproduced leader is predicted at least this much (relative) faster than every other layout."""
BOUND = 1e3
"""Upper bound on each constant in fit units (the fit's own column scaling): keeps big-M valid."""


def max_leaders(platform: str, sweeps: list[str], max_error: float | None) -> dict:
    serving = paper.base_serving(platform)
    pts = paper.points(platform, sweeps)
    cols = paper.columns()
    d = paper.design(paper.feature_table(serving, pts), cols)  # [P, 4, C] seconds per unit constant
    t = paper.measured_seconds(pts)  # [P, 4]
    fixed = cols.index("overhead")
    free = [k for k in range(len(cols)) if k != fixed]
    off = d[:, :, fixed]  # [P, 4] seconds of the fixed column (value 1)
    a = d[:, :, free]
    a = a / np.maximum(np.abs(a / t[:, :, None]).max(axis=(0, 1)), 1e-300)
    n_pts, n_c = a.shape[0], a.shape[2]
    big_m = 10 * t.max()
    rows, lo, hi = [], [], []
    for p, b in enumerate(t.argmin(axis=1)):
        for l in range(4):
            if l != b:  # T̂_b <= (1 - LEAD) T̂_l unless point p is given up (y_p = 0)
                r = np.zeros(n_c + n_pts)
                r[:n_c], r[n_c + p] = a[p, b] - (1 - LEAD) * a[p, l], big_m
                rows.append(r), lo.append(-np.inf), hi.append(big_m + (1 - LEAD) * off[p, l] - off[p, b])
            if max_error is not None:  # |T̂_l / T_l - 1| <= max_error
                r = np.zeros(n_c + n_pts)
                r[:n_c] = a[p, l] / t[p, l]
                rows.append(r), lo.append(1 - max_error - off[p, l] / t[p, l])
                hi.append(1 + max_error - off[p, l] / t[p, l])
    res = milp(np.r_[np.zeros(n_c), -np.ones(n_pts)], constraints=LinearConstraint(np.array(rows), lo, hi),
               integrality=np.r_[np.zeros(n_c), np.ones(n_pts)],
               bounds=Bounds(np.zeros(n_c + n_pts), np.r_[np.full(n_c, BOUND), np.ones(n_pts)]),
               options={"time_limit": 120})
    if res.x is None:
        return {"sweeps": sweeps, "points": n_pts, "max_leaders": None, "status": res.message}
    kept = np.round(res.x[n_c:]).astype(bool)
    return {"sweeps": sweeps, "points": n_pts, "max_leaders": int(kept.sum()),
            "left_out": [f"{pts[p].sweep} {pts[p].input_tokens}/B={pts[p].batch}" for p in np.flatnonzero(~kept)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--platform", default="b200", choices=sorted(HALVES))
    ap.add_argument("--max-error", type=float, default=None, help="also bound every relative T_batch error")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    first, second = HALVES[args.platform]
    out = [max_leaders(args.platform, s, args.max_error) for s in (first, second, first + second)]
    for r in out:
        print(f"{'+'.join(r['sweeps']):34s} {r['max_leaders']}/{r['points']}  left out: {r.get('left_out', r.get('status'))}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"platform": args.platform, "max_error": args.max_error, "sets": out}, f, indent=1)


if __name__ == "__main__":
    main()
