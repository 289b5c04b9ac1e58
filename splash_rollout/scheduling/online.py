"""Online correction of θ: the step times this machine measures pull t_ℓ(x; θ) toward what it runs at.

A profile is fitted on one machine and used on another (a preset, a colleague's calibration), and
its errors are rarely uniform: a slower interconnect makes every collective dearer, a slower GEMM
every projection, and the layouts use the two in different proportions -- so the error changes
which layout looks fastest. The engine times every step; this estimator turns those times into
corrections of the cost model's prediction, in four levels, each shrunk toward "θ was right"
until the observations outweigh it:

1. **Stage factors** f_g, shared by every layout. θ's step splits into stage groups
   g ∈ {compute, attention, comm, overhead} (``STAGE_GROUP_OF``; x_g: θ's seconds of group g) and
   the corrected step is Σ_g f_g·x_g. The groups are the hardware's rates, which every layout
   uses, so what one layout's steps say about them transfers to layouts that have not run yet: a
   preset whose collectives are 4x too slow is corrected for TP by DP-attention's steps, and a
   preset that is uniformly 2x off moves every layout alike (the ranking θ gave is kept, not
   upset by one layout looking slow next to unobserved ones). Fit: ridge regression on relative
   error, with y_i the measured seconds of step i and z_i = x_i / y_i,

       f = argmin Σ_i (1 - f·z_i)² + λ Σ_g (f_g - 1)²   =>   (Σ z zᵀ + λI) f = Σ z + λ·1,

   λ = ``prior_steps``: the prior counts as that many observations in which group g was the whole
   step. A group no step exercises stays at 1. Clipped to [1/max_factor, max_factor].
2. **Global factor** exp(g), shared by every layout: with r_i = log(y_i / f·x_i),
   g = Σ_i r_i / (N + ``global_prior_steps``) -- what the ridge, shrunk toward 1, has not yet
   explained of the common error. A layout not yet run gets it too, so a uniformly wrong preset
   never makes the layouts that ran look slow next to those that did not.
3. **Layout factor** exp(a_ℓ), once layout ℓ has run:
   a_ℓ = Σ_{i∈ℓ} (r_i - g) / (n_ℓ + ``layout_prior_steps``) -- the log-mean residual shrunk toward
   0 (factor 1) by that many pseudo-observations. It takes what the shared rates cannot: one
   layout's own kernels or collectives being slower than θ says.
4. **Shape factor** exp(b_c) for the cell c = (layout, step shape) -- decode vs prefill-carrying
   steps and the running requests in powers of two (``step_shape``):
   b_c = Σ_{i∈c} (r_i - g - a_ℓ) / (n_c + ``shape_prior_steps``).

Corrected seconds = (f·x) · exp(g + a_ℓ + b_c). An unobserved layout gets levels 1 and 2; an
unobserved shape of an observed layout, levels 1-3. With no observations every factor is 1 (θ's
prediction).

What is not known cannot be corrected: a layout that has not run may be slower here than θ and the
global factor say. ``uncertainty(ℓ)`` = 1 / sqrt(1/s² + n_ℓ/σ²), s = ``layout_spread``, is the
log-scale doubt about layout ℓ's factor: the posterior spread of a normal prior of spread s (the
spread of per-layout errors) after ℓ's n_ℓ kept steps, each measured with noise σ -- the RMS of the
log residuals about the fitted factors, with ``layout_prior_steps`` pseudo-steps of s² behind it.
The policy asks a candidate to lead by that much more before it switches into it, so a preset's
promise about a layout never run has to be a large one; a layout whose steps have been measured is
doubted only as much as the measurements' noise leaves (a fixed sqrt(k / (n + k)) shrinkage kept 11 %
of doubt after 19 steps that agreed with θ, and with it a 12-15 % lead out). Each cell keeps its
last ``window_steps`` observations, so the estimate follows a machine whose speed drifts (other work
on the same cores), and the fit costs O(observations kept).
Switching steps carry the switch's transfers and are not observed (the caller skips them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from splash_rollout.scheduling.cost_model import STAGE_GROUP_OF

GROUPS = ("compute", "attention", "comm", "overhead")
"""Stage groups the shared factors scale; ``overhead`` is the fixed per-layer / per-step costs."""
_NAMES = tuple(STAGE_GROUP_OF[g] for g in GROUPS[:-1])


def stage_groups(stages: Mapping[str, float]) -> np.ndarray:
    """θ's seconds per stage group of one step: [4] float64 in ``GROUPS`` order (from ``StepCost.stages``)."""
    get = stages.get
    return np.array([sum(get(name, 0.0) for name in _NAMES[0]), sum(get(name, 0.0) for name in _NAMES[1]),
                     sum(get(name, 0.0) for name in _NAMES[2]), get("overhead", 0.0)], dtype=np.float64)


def step_shape(requests: int, prefill_rows: int) -> str:
    """A step's shape cell: ``decode`` or ``prefill`` (the step carries prefill rows), and the
    requests it runs rounded down to a power of two: ``decode/b32`` holds decode steps of 32-63."""
    kind = "prefill" if prefill_rows > 0 else "decode"
    return f"{kind}/b{1 << (max(1, int(requests)).bit_length() - 1)}"


@dataclass(frozen=True)
class CorrectionConfig:
    prior_steps: float = 2.0
    """λ of the shared stage-factor fit: observations the prior (factor 1) is worth per group."""
    global_prior_steps: float = 8.0
    """Pseudo-observations of factor 1 behind the global factor."""
    layout_prior_steps: float = 8.0
    """Pseudo-observations of factor 1 behind each layout's factor."""
    shape_prior_steps: float = 8.0
    """Pseudo-observations of factor 1 behind each (layout, step shape) factor."""
    window_steps: int = 64
    """Observations kept per (layout, step shape) cell: the newest ones."""
    max_factor: float = 8.0
    """Stage factors are clipped to [1/max_factor, max_factor]."""
    layout_spread: float = 0.2
    """Log-scale spread of one layout's error beyond the shared factors, before any of its steps
    (0.2: about ±22 %); 0 trusts θ about layouts never run."""

    def __post_init__(self) -> None:
        if self.layout_spread < 0:
            raise ValueError(f"layout_spread: expected a non-negative log spread, got {self.layout_spread}")
        for name in ("prior_steps", "global_prior_steps", "layout_prior_steps", "shape_prior_steps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected a positive number of pseudo-observations, got {getattr(self, name)}")
        if self.window_steps < 1:
            raise ValueError(f"window_steps: expected a positive integer, got {self.window_steps}")
        if not self.max_factor > 1:
            raise ValueError(f"max_factor: expected a number > 1, got {self.max_factor}")


@dataclass(frozen=True)
class Factors:
    """The corrected θ at one moment: what the policy multiplies θ's predictions by."""

    stage: np.ndarray
    """[4] float64: f_g per stage group (``GROUPS``)."""
    global_log: float = 0.0
    """g: the log factor every layout shares beyond the stage factors."""
    layout_log: Mapping[str, float] = field(default_factory=dict)
    """a_ℓ per observed layout (log factor)."""
    shape_log: Mapping[tuple[str, str], float] = field(default_factory=dict)
    """b_c per observed (layout, step shape) cell (log factor)."""
    observations: Mapping[str, int] = field(default_factory=dict)
    """Observations kept per layout."""
    spread: float = 0.0
    """``CorrectionConfig.layout_spread``."""
    layout_prior_steps: float = 8.0
    """``CorrectionConfig.layout_prior_steps``."""
    noise: float = 0.0
    """σ: the log-scale noise of one measured step about its fitted factors (0: ``spread``)."""

    def seconds(self, layout: str, shape: str, groups: np.ndarray) -> float:
        """Corrected seconds of a step θ splits into ``groups`` ([4] seconds per stage group)."""
        base = float(self.stage @ groups)
        return base * math.exp(self.global_log + self.layout_log.get(layout, 0.0)
                               + self.shape_log.get((layout, shape), 0.0))

    def uncertainty(self, layout: str) -> float:
        """Log-scale doubt about ``layout``'s factor: the posterior spread of a normal prior of spread
        ``spread`` after its n kept steps, each measured with noise σ: 1 / sqrt(1/spread² + n/σ²)."""
        if self.spread <= 0:
            return 0.0
        noise = self.noise or self.spread
        return 1.0 / math.sqrt(1.0 / self.spread ** 2 + self.observations.get(layout, 0) / noise ** 2)

    def to_dict(self) -> dict:
        """What a decision record shows: the factors (not logs), rounded to 4 digits."""
        return {"stage": {g: round(float(f), 4) for g, f in zip(GROUPS, self.stage)},
                "global": round(math.exp(self.global_log), 4),
                "layout": {l: round(math.exp(a), 4) for l, a in self.layout_log.items()},
                "shape": {f"{l}:{s}": round(math.exp(b), 4) for (l, s), b in self.shape_log.items()},
                "observations": dict(self.observations)}


class StepTimeCorrection:
    """Measured step seconds in, corrected θ out (the estimator in the module docstring)."""

    def __init__(self, config: CorrectionConfig = CorrectionConfig()) -> None:
        self.config = config
        self._cells: dict[tuple[str, str], np.ndarray] = {}
        """(layout, shape) -> [window_steps, 5] ring of (groups [4], measured seconds) rows."""
        self._count: dict[tuple[str, str], int] = {}
        """(layout, shape) -> observations ever made in the cell (the ring keeps the newest)."""
        self._factors: Factors | None = Factors(np.ones(len(GROUPS)), spread=config.layout_spread,
                                                 layout_prior_steps=config.layout_prior_steps)

    def observe(self, layout: str, shape: str, groups, measured_s: float) -> None:
        """One step that ran in ``layout`` (its value string) with ``shape`` (``step_shape``):
        θ's seconds per stage group ([4], ``stage_groups``) and the seconds it took."""
        x = np.asarray(groups, dtype=np.float64).reshape(-1)
        if x.shape != (len(GROUPS),) or not np.all(np.isfinite(x)) or (x < 0).any():
            raise ValueError(f"groups: expected {len(GROUPS)} finite non-negative seconds, got {groups!r}")
        if not (measured_s > 0 and math.isfinite(measured_s)) or x.sum() <= 0:
            return  # a step with no time, or one θ prices at nothing, says nothing about θ's error
        key = (layout, shape)
        ring = self._cells.get(key)
        if ring is None:
            ring = self._cells[key] = np.zeros((self.config.window_steps, len(GROUPS) + 1))
        n = self._count.get(key, 0)
        ring[n % len(ring), :-1] = x
        ring[n % len(ring), -1] = measured_s
        self._count[key] = n + 1
        self._factors = None

    @property
    def num_observations(self) -> int:
        """Observations kept (at most ``window_steps`` per cell)."""
        return sum(min(n, self.config.window_steps) for n in self._count.values())

    def factors(self) -> Factors:
        """The current fit (recomputed only after new observations)."""
        if self._factors is None:
            self._factors = self._fit()
        return self._factors

    def _fit(self) -> Factors:
        cfg = self.config
        keys = list(self._cells)
        kept = [min(self._count[k], cfg.window_steps) for k in keys]
        rows = np.concatenate([self._cells[k][:n] for k, n in zip(keys, kept)])  # [N, 5]
        x, y = rows[:, :-1], rows[:, -1]  # θ's group seconds [N, 4], measured seconds [N]
        cell_of = np.repeat(np.arange(len(keys)), kept)  # [N]
        z = x / y[:, None]
        lam = cfg.prior_steps
        f = np.linalg.solve(z.T @ z + lam * np.eye(len(GROUPS)), z.sum(axis=0) + lam)
        f = np.clip(f, 1.0 / cfg.max_factor, cfg.max_factor)
        r = np.log(y / np.maximum(x @ f, 1e-30))  # [N] log residual after the shared stage factors
        g = float(r.sum()) / (r.size + cfg.global_prior_steps)
        r = r - g
        layouts = sorted({l for l, _ in keys})
        lay_of_cell = np.array([layouts.index(l) for l, _ in keys])
        lay_of = lay_of_cell[cell_of]
        n_l = np.bincount(lay_of, minlength=len(layouts))
        a = np.bincount(lay_of, weights=r, minlength=len(layouts)) / (n_l + cfg.layout_prior_steps)
        n_c = np.bincount(cell_of, minlength=len(keys))
        b = np.bincount(cell_of, weights=r - a[lay_of], minlength=len(keys)) / (n_c + cfg.shape_prior_steps)
        # σ² of one step about its fit, with layout_prior_steps pseudo-steps of layout_spread² behind it
        resid = r - a[lay_of] - b[cell_of]
        k = cfg.layout_prior_steps
        noise = math.sqrt((float(resid @ resid) + k * cfg.layout_spread ** 2) / (resid.size + k))
        return Factors(f, g, {l: float(a[i]) for i, l in enumerate(layouts)},
                       {k: float(b[i]) for i, k in enumerate(keys)},
                       {l: int(n_l[i]) for i, l in enumerate(layouts)}, cfg.layout_spread, cfg.layout_prior_steps,
                       noise)
