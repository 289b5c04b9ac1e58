"""The three platforms the published sweeps were measured on, and Serving YAML load/save.

Each platform binds the model the authors ran there to a θ and a serving setup:

* ``b200``: GLM-5 dims (the paper's GLM-5.3, 78 layers, FP8), prefill on 8 GPUs in the layout under
  test at memory fraction 0.85, decode on 16 GPUs in DP-attention.
* ``h200``: DeepSeek-V3.2 FP8, memory fraction 0.90, one prefill and one decode instance of 8 GPUs.
* ``dcu``: GLM-5.3-Flash (INT8 weights, FP8 KV, 45 layers of which 11 are MLA and 34 KDA) on 8
  BW1000 DCUs, decode on 16. This package's models have no KDA layer, so the DCU model is the 11
  MLA layers with GLM-5 dims (``DCU_MODEL``): they are what the attention layout changes; the KDA
  layers' work is the same in every layout and ends up in the fitted common terms. Its KV bytes per
  token differ from the real model's, so the pools are matched in tokens, not in GiB.

``spec_serving`` gives the unfitted setup (spec-sheet rates, pools matched to the published
allocations through ``workspace_bytes``); the fitted presets in ``presets/*.yaml`` are what
``python -m splash_rollout.sim fit`` wrote from it.

Serving YAML: ``{model, profile: <HardwareProfile fields>, decode: {world_size} | null,
kv_transfer_Bps, decode_scale, batch_overhead_s: {tp, cp, dp, dop}}`` (seconds per batch per prefill
layout; a YAML written before it was per layout holds one number, read as that number for every
layout).
"""
from __future__ import annotations

import os
from pathlib import Path
from numbers import Real
from typing import Any, Mapping

import yaml

from splash_rollout.layout import GiB, MiB
from splash_rollout.models.config import PRESETS as MODELS
from splash_rollout.models.config import ModelConfig, resolve_model
from splash_rollout.scheduling.deployment import Deployment, Serving
from splash_rollout.scheduling.profile import PRESETS as SPEC_PROFILES
from splash_rollout.scheduling.profile import CollectiveCost, HardwareProfile

PRESET_DIR = Path(__file__).with_name("presets")
DCU_MODEL: ModelConfig = MODELS["glm-5"].replace(name="glm-5.3-flash-mla", num_layers=11, first_k_dense_replace=1,
                                             indexer_types=("full",) * 11)

# BW1000: no public spec sheet we could cite; assumed 64 GiB HBM at 1.6 TB/s, 400 TFLOP/s INT8 and
# 200 TFLOP/s bf16, 200 GB/s links. The fit corrects the rates through its stage scales.
_DCU = HardwareProfile(
    name="dcu", world_size=8, memory_bytes=64 * GiB, mem_fraction=0.85, matmul_flops=400e12 * 0.55,
    attention_flops=200e12 * 0.45, weight_read_Bps=1.6e12 * 0.8, kv_read_Bps=1.6e12 * 0.7,
    all_gather=CollectiveCost(15e-6, 100e9 * 0.75), all_to_all=CollectiveCost(18e-6, 100e9 * 0.75),
    all_reduce=CollectiveCost(20e-6, 100e9 * 0.7))

PLATFORMS: dict[str, dict[str, Any]] = {
    "b200": {"model": "glm-5", "profile": SPEC_PROFILES["b200"], "decode_world_size": 16,
             "kv_transfer_Bps": 50e9 * 0.7},
    "h200": {"model": "deepseek-v3.2", "profile": SPEC_PROFILES["h200"], "decode_world_size": 8,
             "kv_transfer_Bps": 50e9 * 0.7},
    "dcu": {"model": DCU_MODEL, "profile": _DCU, "decode_world_size": 16, "kv_transfer_Bps": 25e9 * 0.7},
}
"""Per platform: model, spec θ of one prefill group, decode group size, KV transfer rate of one
sending rank (B/s: its own NIC, 400 Gb/s on the GPUs, 200 Gb/s assumed on the DCUs, x 0.7)."""

CHUNK_TOKENS = 16384
"""Prefill rows per step over the group (SGLang's chunked-prefill size on these GPUs: a 256K prompt
spans 16 steps in TP / CP; DP-attention and DOP give each of 8 owners 2,048, so 128 steps)."""


def platform_model(platform: str) -> ModelConfig:
    return resolve_model(_platform(platform)["model"])


def _platform(name: str) -> dict[str, Any]:
    key = name.lower()
    if key not in PLATFORMS:
        raise ValueError(f"platform: expected one of {sorted(PLATFORMS)}, got {name!r}")
    return PLATFORMS[key]


def workspace_for_pools(model: ModelConfig, profile: HardwareProfile, pool_tokens: Mapping[str, int],
                        page_size: int = 64) -> dict[str, int]:
    """Per-layout ``workspace_bytes`` that make ``Deployment.build`` give ``pool_tokens`` per rank
    (each rounded up to a whole page: the pool rounds down to pages)."""
    bare = Deployment.build(model, profile.replace(workspace_bytes={}), page_size=page_size)
    out = {}
    for layout, fp in bare.footprints.items():
        target = -(-int(pool_tokens[layout.value]) // page_size) * page_size
        spare = (fp.pool_tokens_per_rank - target) * fp.kv_bytes_per_token
        if spare < 0:
            raise ValueError(f"pool_tokens[{layout.value!r}]: {target} tokens exceed what {profile.name} can hold "
                             f"({fp.pool_tokens_per_rank})")
        out[layout.value] = int(spare)
    return out


def spec_serving(platform: str, pool_tokens: Mapping[str, int] | None = None) -> Serving:
    """The unfitted setup of ``platform``: spec θ, chunk budgets, and pools matched to
    ``pool_tokens`` (per-rank tokens per layout) when given."""
    p = _platform(platform)
    model = resolve_model(p["model"])
    prof = p["profile"].replace(chunk_tokens={l: CHUNK_TOKENS for l in ("tp", "cp", "dp", "dop")})
    if pool_tokens is not None:
        prof = prof.replace(workspace_bytes=workspace_for_pools(model, prof, pool_tokens))
    return build_serving(model, prof, p["decode_world_size"], p["kv_transfer_Bps"])


def build_serving(model: ModelConfig | str, profile: HardwareProfile, decode_world_size: int | None,
                  kv_transfer_Bps: float = 0.0, decode_scale: float = 1.0,
                  batch_overhead_s: Mapping[str, float] | float = 0.0) -> Serving:
    """A Serving of ``model`` on ``profile``'s prefill group and, when ``decode_world_size`` is set, a
    decode group of that many ranks; ``batch_overhead_s`` per prefill layout (seconds) or one number
    for every layout."""
    prefill = Deployment.build(model, profile)
    decode = None
    if decode_world_size:
        # the decode group prices with the plain roofline (its fitted correction is decode_scale);
        # its pool keeps the DP-attention workspace of the prefill group
        dprof = profile.replace(world_size=int(decode_world_size), stage_scale={}, layout_step_s={},
                                layout_request_s={}, layout_token_s={})
        decode = Deployment.build(model, dprof)
    return Serving(prefill, decode, kv_transfer_Bps, decode_scale, batch_overhead_s)


def serving_to_dict(serving: Serving) -> dict[str, Any]:
    model = serving.prefill.model
    return {"model": model.name if MODELS.get(model.name) is model or model is DCU_MODEL else model.name,
            "profile": serving.prefill.profile.to_dict(),
            "decode": None if serving.decode is None else {"world_size": serving.decode.world_size},
            "kv_transfer_Bps": float(serving.kv_transfer_Bps), "decode_scale": float(serving.decode_scale),
            "batch_overhead_s": {k: float(v) for k, v in serving.batch_overhead_s.items()}}


def serving_from_dict(raw: Mapping[str, Any], source: str = "serving") -> Serving:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{source}: expected a mapping with model, profile, decode, ...")
    missing = [k for k in ("model", "profile") if k not in raw]
    if missing:
        raise ValueError(f"{source}: missing field {missing[0]!r}")
    unknown = sorted(set(raw) - {"model", "profile", "decode", "kv_transfer_Bps", "decode_scale", "batch_overhead_s"})
    if unknown:
        raise ValueError(f"{source}: unknown field {unknown[0]!r}")
    name = str(raw["model"])
    model = DCU_MODEL if name == DCU_MODEL.name else resolve_model(name)
    profile = HardwareProfile.from_dict(raw["profile"], source=f"{source} profile")
    decode = raw.get("decode")
    if decode is not None and (not isinstance(decode, Mapping) or "world_size" not in decode):
        raise ValueError(f"{source}: bad field 'decode': expected null or {{world_size: N}}")
    batch = raw.get("batch_overhead_s", 0.0)
    if not isinstance(batch, (Mapping, Real)) or isinstance(batch, bool):
        raise ValueError(f"{source}: bad field 'batch_overhead_s': expected a number or a mapping "
                         f"{{layout: seconds}}, got {batch!r}")
    try:
        return build_serving(model, profile, None if decode is None else int(decode["world_size"]),
                             float(raw.get("kv_transfer_Bps", 0.0)), float(raw.get("decode_scale", 1.0)),
                             dict(batch) if isinstance(batch, Mapping) else float(batch))
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def load_serving(source: str | os.PathLike) -> Serving:
    """A platform name (its fitted preset) or a Serving YAML written by ``save_serving``."""
    key = os.fspath(source)
    path = PRESET_DIR / f"{key.lower()}.yaml" if key.lower() in PLATFORMS else Path(key)
    if not path.is_file():
        raise ValueError(f"profile: unknown platform or file {key!r}; platforms are {sorted(PLATFORMS)}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"profile: {key!r} is not valid YAML ({str(e).splitlines()[0]})") from None
    return serving_from_dict(raw, source=f"profile {key!r}")


def save_serving(serving: Serving, path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(serving_to_dict(serving), f, sort_keys=False)
