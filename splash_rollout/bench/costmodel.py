"""Measured vs predicted per-layout step latency on this machine (issue: the cost model must track
the engine): the ``layouts`` benchmark's grid, each point also priced by ``scheduling.cost_model``
with a profile, reporting the median absolute relative error and how often the predicted fastest
layout is the measured fastest.
"""
from __future__ import annotations

import statistics

import torch

from splash_rollout.engine.rank_engine import sizes_for
from splash_rollout.models.config import resolve_model
from splash_rollout.scheduling.fit import predict_point
from splash_rollout.scheduling.profile import load_profile


def predict(points: list[dict], model: str, profile_source: str, world_size: int) -> list[dict]:
    """Each measured point with the cost model's ``predicted_prefill_ms`` / ``predicted_decode_ms``."""
    cfg = resolve_model(model)
    profile = load_profile(profile_source).replace(world_size=world_size)
    sizes = sizes_for(cfg, torch.float32)
    out = []
    for p in points:
        prefill_ms, decode_ms = predict_point(p, cfg, profile, sizes)
        out.append(dict(p, predicted_prefill_ms=prefill_ms, predicted_decode_ms=decode_ms))
    return out


def summarize(points: list[dict]) -> dict:
    errors, agree, total = [], 0, 0
    for kind in ("prefill", "decode"):
        for p in points:
            errors.append(abs(p[f"predicted_{kind}_ms"] - p[f"{kind}_ms"]) / p[f"{kind}_ms"])
        cells = {(p["batch"], p["context"]) for p in points}
        for cell in cells:
            here = [p for p in points if (p["batch"], p["context"]) == cell]
            measured = min(here, key=lambda p: p[f"{kind}_ms"])["layout"]
            predicted = min(here, key=lambda p: p[f"predicted_{kind}_ms"])["layout"]
            agree += measured == predicted
            total += 1
    return {"median_abs_error": statistics.median(errors), "best_layout_agreement": agree / total}
