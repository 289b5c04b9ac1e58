"""Small numpy optimisers the fits need: nonnegative least squares (plain and with squared-hinge
rows) and a bounded Levenberg-Marquardt.

The package keeps numpy as its only numerical dependency. Two problems need an optimiser: a fit
that is linear in its constants once the roofline seconds are known (the published sweeps: NNLS,
Lawson-Hanson active set; with ordering penalties, NNLS over the rows whose hinge is active, repeated
until that set settles), and one whose residuals are nonlinear in a few log-constants (the CPU
engine grid: Levenberg-Marquardt with a forward-difference Jacobian, box bounds by clipping and a
soft-L1 loss by reweighting).
"""
from __future__ import annotations

from typing import Callable

import numpy as np


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None, tol: float = 1e-12) -> np.ndarray:
    """argmin_x ||a x - b||_2 subject to x >= 0 (Lawson-Hanson). a: [M, N] float, b: [M] float → [N]."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64).reshape(-1)
    if a.ndim != 2 or a.shape[0] != b.size:
        raise ValueError(f"nnls: expected a [M, N] matrix and [M] vector, got {a.shape} and {b.shape}")
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    max_iter = 3 * n + 30 if max_iter is None else max_iter
    w = a.T @ (b - a @ x)
    for _ in range(max_iter):
        if passive.all() or (w[~passive] <= tol * max(1.0, np.abs(w).max())).all():
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            bad = passive & (z <= 0)
            alpha = np.min(x[bad] / np.maximum(x[bad] - z[bad], 1e-300))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        w = a.T @ (b - a @ x)
    return x


def nnls_hinge(a: np.ndarray, b: np.ndarray, g: np.ndarray, c: np.ndarray,
               max_rounds: int = 50) -> tuple[np.ndarray, int]:
    """argmin_x ||a x - b||² + Σ_i max(0, g_i·x - c_i)² subject to x >= 0.

    a: [M, N], b: [M], g: [K, N], c: [K] (float) → (x [N], rounds). The objective is convex and
    piecewise quadratic: on the set of rows whose hinge is active (g_i·x > c_i) it is a plain NNLS
    with those rows appended. Starting from the NNLS of ``a`` alone, each round solves that NNLS for
    the rows active at the current x and recomputes the active set; at a fixed point x is optimal
    (rows exactly at their hinge contribute no gradient either way). Should the sets cycle, the
    best objective seen is returned after ``max_rounds``."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64).reshape(-1)
    g = np.asarray(g, dtype=np.float64)
    c = np.asarray(c, dtype=np.float64).reshape(-1)
    if a.ndim != 2 or g.ndim != 2 or g.shape != (c.size, a.shape[1]):
        raise ValueError(f"nnls_hinge: expected a [M, N], g [K, N] and c [K], got {a.shape}, {g.shape}, {c.shape}")

    def objective(x: np.ndarray) -> float:
        return float(((a @ x - b) ** 2).sum() + (np.maximum(g @ x - c, 0.0) ** 2).sum())

    x = nnls(a, b)
    best, best_obj = x, objective(x)
    active = g @ x > c
    for rounds in range(1, max_rounds + 1):
        x = nnls(np.vstack([a, g[active]]), np.concatenate([b, c[active]]))
        obj = objective(x)
        if obj < best_obj:
            best, best_obj = x, obj
        now = g @ x > c
        if (now == active).all():
            return x, rounds
        active = now
    return best, max_rounds


def levenberg_marquardt(residuals: Callable[[np.ndarray], np.ndarray], x0: np.ndarray, lower: np.ndarray,
                        upper: np.ndarray, max_evals: int = 2000, f_scale: float | None = None,
                        step: float = 1e-4) -> tuple[np.ndarray, np.ndarray, int]:
    """Minimise Σ ρ(r_i(x)) within [lower, upper]; ρ is r² (``f_scale`` None) or soft-L1 with that
    scale. Returns (x, residuals at x, evaluations)."""
    x = np.clip(np.asarray(x0, dtype=np.float64), lower, upper)
    evals = 0

    def f(v: np.ndarray) -> np.ndarray:
        nonlocal evals
        evals += 1
        return np.asarray(residuals(v), dtype=np.float64)

    def weights(r: np.ndarray) -> np.ndarray:  # IRLS weights of the soft-L1 loss
        return np.ones_like(r) if f_scale is None else (1.0 + (r / f_scale) ** 2) ** -0.25

    def loss(r: np.ndarray) -> float:
        if f_scale is None:
            return float(r @ r)
        return float(2 * f_scale ** 2 * np.sum(np.sqrt(1.0 + (r / f_scale) ** 2) - 1.0))

    r = f(x)
    damping = 1e-3
    while evals < max_evals:
        jac = np.empty((r.size, x.size))
        for i in range(x.size):
            h = step * max(1.0, abs(x[i]))
            xi = x.copy()
            xi[i] = xi[i] + h if xi[i] + h <= upper[i] else xi[i] - h
            jac[:, i] = (f(xi) - r) / (xi[i] - x[i])
        w = weights(r)
        jw, rw = jac * w[:, None], r * w
        g, hess = jw.T @ rw, jw.T @ jw
        improved = False
        while evals < max_evals and damping < 1e12:
            dx = -np.linalg.solve(hess + damping * np.diag(np.diag(hess) + 1e-12), g)
            x_new = np.clip(x + dx, lower, upper)
            r_new = f(x_new)
            if np.isfinite(r_new).all() and loss(r_new) < loss(r):
                shrink = loss(r) - loss(r_new)
                x, r, damping, improved = x_new, r_new, max(damping / 3, 1e-9), True
                break
            damping *= 4
        if not improved or shrink < 1e-12 * max(loss(r), 1e-300):
            break
    return x, r, evals
