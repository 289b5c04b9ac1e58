"""Fit θ to measured engine steps: the calibrated half of the cost model.

Microbenchmarks (``python -m splash_rollout.calibrate``) give a first θ: GEMM rate, memory
bandwidth, collective latency and bandwidth. A real engine step also pays what no microbenchmark
sees -- per-request work, elementwise passes over score tensors, per-expert calls, the step's own
bookkeeping -- and its kernels run at other rates than a square GEMM. So the calibration also runs
the engine itself over a grid of batches (every layout, prefill and decode steps) and fits the
constants of ``cost_model.step_time`` to those measurements here.

The fit (a bounded Levenberg-Marquardt, ``numeric_fit.py``) minimises the robust (soft-L1) sum of log(predicted / measured) over every measured step,
so a 10 ms step and a 10 s step weigh the same; every constant stays positive (it is fitted in log
space). Rates and memory bandwidths keep their microbenchmark values: fitted too, they trade off
against the elementwise and per-request terms and drift to unphysical values (a 386 TFLOP/s
"GEMM rate" on two CPU cores) for no gain on held-out points.

A measured point (the ``bench layouts`` record): ``{"layout", "batch", "context", "prefill_ms",
"decode_ms"}``; a prefill step runs ``batch`` prompts of ``context`` tokens whole, a decode step
one row per request at about ``context + DECODE_OFFSET`` tokens of history.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from splash_rollout.layout import AttentionBytes, Layout
from splash_rollout.models.config import ModelConfig
from splash_rollout.scheduling.cost_model import StepBatch, step_time
from splash_rollout.scheduling.numeric_fit import levenberg_marquardt
from splash_rollout.scheduling.profile import COLLECTIVES, CollectiveCost, HardwareProfile

DECODE_OFFSET = 4
"""History of a measured decode step beyond the prompt (the median of ``bench layouts``' steps)."""

RATES: tuple[str, ...] = ()
FIXED = ("step_overhead_s", "layer_overhead_s", "request_layer_s", "request_step_s", "score_element_s",
         "expert_call_s")
FITTED = RATES + FIXED + tuple(f"{c}.{part}" for c in COLLECTIVES for part in ("latency_s", "bandwidth_Bps"))
"""The constants the fit moves, in the order of the parameter vector."""

_FLOOR = {"score_element_s": 1e-11, "bandwidth_Bps": 1e6, "latency_s": 1e-7}


def point_batches(point: dict, world_size: int) -> tuple[StepBatch, StepBatch]:
    """(prefill, decode) StepBatch of one measured grid point; owners round-robin, as the engine
    places equal requests."""
    b, s = int(point["batch"]), int(point["context"])
    owners = np.arange(b) % world_size
    return (StepBatch.make([s] * b, [s] * b, owners),
            StepBatch.make([s + DECODE_OFFSET] * b, [1] * b, owners))


def predict_point(point: dict, model: ModelConfig, profile: HardwareProfile, sizes: AttentionBytes) -> tuple[float, float]:
    """Predicted (prefill_ms, decode_ms) of one grid point."""
    layout = Layout.parse(point["layout"])
    prefill, decode = point_batches(point, profile.world_size)
    return (1e3 * step_time(layout, prefill, model, profile, sizes).seconds,
            1e3 * step_time(layout, decode, model, profile, sizes).seconds)


def _get(profile: HardwareProfile, name: str) -> float:
    if "." in name:
        coll, part = name.split(".")
        return getattr(getattr(profile, coll), part)
    return getattr(profile, name)


def _with(profile: HardwareProfile, values: Sequence[float]) -> HardwareProfile:
    changes: dict = {}
    colls = {c: dataclasses.asdict(getattr(profile, c)) for c in COLLECTIVES}
    for name, v in zip(FITTED, values):
        if "." in name:
            coll, part = name.split(".")
            colls[coll][part] = float(v)
        else:
            changes[name] = float(v)
    changes.update({c: CollectiveCost(**colls[c]) for c in COLLECTIVES})
    return profile.replace(**changes)


def _start(profile: HardwareProfile, name: str) -> float:
    v = _get(profile, name)
    if v > 0:
        return v
    return {"score_element_s": 1e-9, "expert_call_s": 1e-5, "request_layer_s": 1e-5, "request_step_s": 1e-4}.get(name, 1e-5)


def fit_profile(points: Sequence[dict], model: ModelConfig, sizes: AttentionBytes, base: HardwareProfile,
                max_evals: int = 4000, engine: str = "cpu") -> tuple[HardwareProfile, dict]:
    """θ fitted to ``points`` (measured with ``base.world_size`` ranks on the engine kind ``engine``:
    ``cpu`` for the native backend, ``torch_ref`` for the torch ones), starting from ``base``;
    returns (profile with that ``engine``, report {median_abs_error, points, evaluations})."""
    if not points:
        raise ValueError("points: expected at least one measured grid point")
    base = base.replace(engine=engine)
    x0 = np.log([_start(base, n) for n in FITTED])
    floors = np.log([next((f for k, f in _FLOOR.items() if n.endswith(k)), 1e-12) for n in FITTED])
    measured = np.log([[p["prefill_ms"], p["decode_ms"]] for p in points]).reshape(-1)

    def residuals(x: np.ndarray) -> np.ndarray:
        prof = _with(base, np.exp(x))
        pred = np.array([predict_point(p, model, prof, sizes) for p in points]).reshape(-1)
        return np.log(pred) - measured

    lower = np.maximum(floors, x0 - 25.0)
    upper = x0 + 25.0
    x, fun, evals = levenberg_marquardt(residuals, np.clip(x0, lower + 1e-9, upper - 1e-9), lower, upper,
                                        max_evals=max_evals, f_scale=0.1)
    fitted = _with(base, np.exp(x))
    errors = np.abs(np.expm1(fun))
    report = {"median_abs_error": float(np.median(errors)), "max_abs_error": float(errors.max()),
              "points": len(points), "evaluations": int(evals),
              "constants": {n: _get(fitted, n) for n in FITTED}}
    if not math.isfinite(report["median_abs_error"]):
        raise RuntimeError("fit_profile: the fit diverged (non-finite residuals)")
    return fitted, report
