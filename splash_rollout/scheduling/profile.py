"""Hardware profile θ: the constants the cost model turns per-rank loads into seconds with.

Paper §4.2: θ is the group size T, device memory, compute rate, weight-read, KV-read and
interconnect bandwidths and fixed collective latency, calibrated once per deployment. This file
holds the record, presets from public specs, and YAML load/save. A calibration command (elsewhere)
measures the actual group and writes the same YAML.

Preset numbers (per GPU, all "achievable", i.e. spec peak times an efficiency factor):

* matmul: dense tensor-core peak x 0.55. Large-batch GEMMs reach 60-75 % of peak; MoE grouped
  GEMMs with few rows per expert and fp8 block scaling reach less, so 0.55 is a middle value.
  ``matmul_flops`` is the rate for the checkpoint's weight dtype (fp8 presets: the fp8 peak).
* attention: bf16 peak x 0.45 (FlashMLA-class absorbed-MLA kernels on long histories reach about
  half of the bf16 peak; the fp8 DSA indexer is counted at the same rate, a conservative choice).
* HBM: spec bandwidth x 0.80 for weight reads (large contiguous reads) and x 0.70 for KV reads
  (paged gathers of 656-byte rows are less efficient).
* NVLink: the per-direction bandwidth (half the bidirectional spec) x 0.75 for all-gather and
  all-to-all, and x 0.70 for all-reduce (bus bandwidth, ring / NVLS); latencies are the usual
  8-GPU small-message NCCL figures (all-reduce about 12-20 us, all-gather / all-to-all 8-15 us).
* per-step overhead (scheduling, sampling, launch of the step) 1.5 ms; per-layer launch overhead
  15 us (kernels of one layer under CUDA graphs still pay per-kernel gaps).

Memory is what the device reports (nvidia-smi MiB figures), not the marketing "GB".
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import yaml

from splash_rollout.layout import FEED_FORWARD_PLACEMENTS, GiB, MiB

COLLECTIVES = ("all_gather", "all_to_all", "all_reduce")
ENGINES = ("ideal", "torch_ref", "cpu")
OVERHEAD_FIELDS = ("request_layer_s", "request_step_s", "score_element_s", "expert_call_s")
LAYOUT_NAMES = ("tp", "cp", "dp", "dop")
STAGE_GROUPS = ("compute", "attention", "comm")
"""Keys of ``stage_scale``: ``compute`` (attn_in, attn_proj, mlp, lm_head), ``attention`` (attention,
indexer), ``comm`` (attn_comm, mlp_comm)."""
PER_LAYOUT_FIELDS = {"layout_step_s": float, "layout_request_s": float, "layout_token_s": float, "chunk_tokens": int,
                     "workspace_bytes": int}
"""Per-layout mappings ({layout name: value}); a layout absent from one takes its default (0, or
for ``chunk_tokens`` the caller's budget)."""


@dataclass(frozen=True)
class CollectiveCost:
    """Time of one collective: ``latency_s + bytes_per_rank / bandwidth_Bps``."""

    latency_s: float
    """Fixed cost of one call (s)."""
    bandwidth_Bps: float
    """Bytes per second one rank moves (sent or received, whichever is larger), B/s."""

    def time(self, bytes_per_rank: float) -> float:
        """Seconds for one call that moves ``bytes_per_rank`` on the busiest rank (0 bytes: 0 s)."""
        if bytes_per_rank <= 0:
            return 0.0
        return self.latency_s + bytes_per_rank / self.bandwidth_Bps


@dataclass(frozen=True)
class HardwareProfile:
    """θ for one group of T ranks (one NVLink island)."""

    name: str
    world_size: int
    """T: ranks in the attention group."""
    memory_bytes: int
    """Device memory per rank (bytes)."""
    mem_fraction: float
    """Share of memory the engine uses (SGLang mem_fraction_static)."""
    matmul_flops: float
    """Achievable GEMM rate for the weight dtype (FLOP/s per rank)."""
    attention_flops: float
    """Achievable rate of the attention and indexer kernels (FLOP/s per rank)."""
    weight_read_Bps: float
    """HBM bandwidth for weight reads (B/s per rank)."""
    kv_read_Bps: float
    """HBM bandwidth for KV reads (B/s per rank)."""
    all_gather: CollectiveCost
    all_to_all: CollectiveCost
    all_reduce: CollectiveCost
    step_overhead_s: float = 1.5e-3
    """Fixed cost of one serving step (scheduling, sampling, launch), s."""
    layer_overhead_s: float = 15e-6
    """Fixed cost per decoder layer per step (kernel gaps), s."""
    reserve_bytes: int = 0
    """Transient reserve kept out of the KV pool (bytes), on top of mem_fraction."""
    engine: str = "ideal"
    """Which attention algorithms the priced engine runs (ENGINES): ``ideal`` -- paged kernels that
    touch only causal / selected keys, CP with pass-Q and pass-KV (the paper's engine; the GPU
    presets); ``torch_ref`` -- this package's reference and batched torch backends; ``cpu`` -- the
    native CPU backend under fast numerics (what ``calibrate`` measures by default): paged
    attention over causal / selected keys, long prefill chunks in expanded form, otherwise the
    reference engine's indexer and CP."""
    feed_forward: str = "sharded"
    """Where the priced engine keeps its MLP / MoE weights (FEED_FORWARD_PLACEMENTS): ``sharded`` --
    1/T per rank, a collective closing every block; ``replicated`` -- whole on every rank, each rank
    computing its own rows (DP-attention) or a 1/T slice of them (other layouts) then one all-gather."""
    request_layer_s: float = 0.0
    """Fixed cost per request per decoder layer on the busiest rank (per-request kernels), s."""
    request_step_s: float = 0.0
    """Fixed cost per request per step (scheduling, batch building, sampling), s."""
    score_element_s: float = 0.0
    """Cost per float32 element of the score tensors (attention logits, indexer scores, top-k
    selection) beyond their FLOPs: the elementwise passes a reference backend makes, s."""
    expert_call_s: float = 0.0
    """Fixed cost per routed expert a rank runs in one MoE layer, s."""
    layout_step_s: Mapping[str, float] = field(default_factory=dict)
    """Per layout: fixed cost of one step that runs prefill rows, beyond ``step_overhead_s`` (the
    layout's own prefill scheduling, metadata gathers, launch), s. Decode-only steps do not pay it."""
    layout_request_s: Mapping[str, float] = field(default_factory=dict)
    """Per layout: fixed cost per request, charged once, on the step that completes its prefill
    (per-request setup a layout pays: DP-attention's per-owner scheduling and KV bootstrap), s."""
    layout_token_s: Mapping[str, float] = field(default_factory=dict)
    """Per layout: cost per prefill row beyond the roofline stages (per-token work of the layout's
    kernels that no stage prices: layout-specific gathers, metadata, the real kernels' rates), s."""
    chunk_tokens: Mapping[str, int] = field(default_factory=dict)
    """Per layout: prefill rows one step may run over the whole group (chunked-prefill budget).
    DP-attention and DOP split it evenly over the owners, as each owner schedules its own rows."""
    workspace_bytes: Mapping[str, int] = field(default_factory=dict)
    """Per layout: memory kept out of the KV pool beyond weights and ``reserve_bytes`` (the
    forward pass's activation peak and graph buffers, which differ by layout), bytes."""
    stage_scale: Mapping[str, float] = field(default_factory=dict)
    """Correction factor per stage group (STAGE_GROUPS) on the roofline seconds, fitted to measured
    steps; ``GROUP/LAYOUT`` keys override it for one layout (its kernels' own efficiency); absent: 1."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size: expected a positive integer, got {self.world_size}")
        if self.memory_bytes <= 0:
            raise ValueError(f"memory_bytes: expected a positive size, got {self.memory_bytes}")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ValueError(f"mem_fraction: expected a value in (0, 1], got {self.mem_fraction}")
        for f in ("matmul_flops", "attention_flops", "weight_read_Bps", "kv_read_Bps"):
            if not getattr(self, f) > 0:
                raise ValueError(f"{f}: expected a positive number, got {getattr(self, f)}")
        for c in COLLECTIVES:
            cost = getattr(self, c)
            if cost.latency_s < 0 or not cost.bandwidth_Bps > 0:
                raise ValueError(f"{c}: expected latency_s >= 0 and bandwidth_Bps > 0, got {cost}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine: expected one of {ENGINES}, got {self.engine!r}")
        if self.feed_forward not in FEED_FORWARD_PLACEMENTS:
            raise ValueError(f"feed_forward: expected one of {FEED_FORWARD_PLACEMENTS}, got {self.feed_forward!r}")
        for f in ("step_overhead_s", "layer_overhead_s", "reserve_bytes", *OVERHEAD_FIELDS):
            if getattr(self, f) < 0:
                raise ValueError(f"{f}: expected a non-negative number, got {getattr(self, f)}")
        for f, keys in (*((f, LAYOUT_NAMES) for f in PER_LAYOUT_FIELDS), ("stage_scale", STAGE_GROUPS)):
            value = getattr(self, f)
            if not isinstance(value, Mapping):
                raise ValueError(f"{f}: expected a mapping {{name: number}}, got {type(value).__name__}")
            for k, v in value.items():
                group, _, lay = k.partition("/")
                ok = k in keys if f != "stage_scale" else group in keys and (not lay or lay in LAYOUT_NAMES)
                if not ok:
                    raise ValueError(f"{f}: unknown key {k!r}; expected one of {keys}"
                                     + (" or GROUP/LAYOUT" if f == "stage_scale" else ""))
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (f == "chunk_tokens" and v < 1):
                    raise ValueError(f"{f}[{k!r}]: expected a {'positive' if f == 'chunk_tokens' else 'non-negative'} "
                                     f"number, got {v!r}")

    def per_layout(self, name: str, layout: str, default: float = 0.0) -> float:
        """``name`` (a PER_LAYOUT_FIELDS mapping) for ``layout`` (its value string), or ``default``."""
        return getattr(self, name).get(layout, default)

    def scale(self, group: str, layout: str = "") -> float:
        """Stage-group factor for ``layout``: ``GROUP/LAYOUT`` if set, else ``GROUP``, else 1."""
        return float(self.stage_scale.get(f"{group}/{layout}", self.stage_scale.get(group, 1.0)))

    def replace(self, **changes: Any) -> "HardwareProfile":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for f in (*PER_LAYOUT_FIELDS, "stage_scale"):
            d[f] = dict(d[f])
        return d

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "profile") -> "HardwareProfile":
        if not isinstance(raw, Mapping):
            raise ValueError(f"{source}: expected a mapping of profile fields, got {type(raw).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(fields))
        if unknown:
            raise ValueError(f"{source}: unknown field {unknown[0]!r}")
        kwargs: dict[str, Any] = {}
        for name, f in fields.items():
            if name not in raw:
                if f.default is dataclasses.MISSING:
                    raise ValueError(f"{source}: missing field {name!r}")
                continue
            value = raw[name]
            try:
                if name in COLLECTIVES:
                    if not isinstance(value, Mapping) or set(value) != {"latency_s", "bandwidth_Bps"}:
                        raise ValueError("expected {latency_s, bandwidth_Bps}")
                    value = CollectiveCost(float(value["latency_s"]), float(value["bandwidth_Bps"]))
                elif name in PER_LAYOUT_FIELDS or name == "stage_scale":
                    if not isinstance(value, Mapping):
                        raise ValueError("expected a mapping {name: number}")
                    kind = PER_LAYOUT_FIELDS.get(name, float)
                    value = {str(k): kind(v) if not isinstance(v, bool) else v for k, v in value.items()}
                elif name in ("name", "engine", "feed_forward"):
                    value = str(value)
                elif name in ("world_size", "memory_bytes", "reserve_bytes"):
                    if isinstance(value, bool) or float(value) != int(float(value)):
                        raise ValueError("expected an integer")
                    value = int(float(value))
                else:
                    if isinstance(value, bool):
                        raise ValueError("expected a number")
                    value = float(value)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{source}: bad field {name!r}: {e} (got {raw[name]!r})") from None
            kwargs[name] = value
        try:
            return cls(**kwargs)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None


def _nvlink_gpu(name: str, memory_mib: int, mem_fraction: float, bf16_tflops: float, fp8_tflops: float,
                hbm_TBps: float, nvlink_bidir_GBps: float) -> HardwareProfile:
    link = nvlink_bidir_GBps * 1e9 / 2  # per direction
    return HardwareProfile(
        name=name, world_size=8, memory_bytes=memory_mib * MiB, mem_fraction=mem_fraction,
        matmul_flops=fp8_tflops * 1e12 * 0.55, attention_flops=bf16_tflops * 1e12 * 0.45,
        weight_read_Bps=hbm_TBps * 1e12 * 0.80, kv_read_Bps=hbm_TBps * 1e12 * 0.70,
        all_gather=CollectiveCost(10e-6, link * 0.75), all_to_all=CollectiveCost(12e-6, link * 0.75),
        all_reduce=CollectiveCost(15e-6, link * 0.70))


PRESETS: dict[str, HardwareProfile] = {
    # H100 SXM: 80 GB HBM3 (81,559 MiB reported), 3.35 TB/s, 989 TFLOP/s bf16 / 1,979 fp8 dense,
    # NVLink4 900 GB/s bidirectional.
    "h100": _nvlink_gpu("h100", 81_559, 0.85, 989.0, 1979.0, 3.35, 900.0),
    # H200 SXM: 141 GB HBM3e (143,771 MiB), 4.8 TB/s, same compute and NVLink as H100.
    "h200": _nvlink_gpu("h200", 143_771, 0.90, 989.0, 1979.0, 4.8, 900.0),
    # B200: 180 GB usable HBM3e (183,359 MiB), ~8 TB/s, 2.25 PFLOP/s bf16 / 4.5 fp8 dense,
    # NVLink5 1.8 TB/s bidirectional.
    "b200": _nvlink_gpu("b200", 183_359, 0.85, 2250.0, 4500.0, 8.0, 1800.0),
    # The CPU engine (its native ``cpu`` attention backend, shared-memory collectives) on two ranks of
    # a 2-core AVX-512 machine, as ``python -m splash_rollout.calibrate --world-size 2`` measured it:
    # rates from the microbenchmarks, the rest fitted to the 128 steps (prefill and decode) of a
    # 64-point grid, median error 11.3 %, max 36 % (the preset before this one, fitted to the engine
    # before L2 prefetch, oneDNN-packed prefill and every rank sampling its own rows, was off by 24 %
    # median on the same grid: the steps had become ~1.28x faster).
    # Recalibrate on other CPUs; ``EngineConfig(pricing={"profile": <yaml>})`` takes the result.
    "cpu": HardwareProfile(
        name="cpu", world_size=2, memory_bytes=1 * GiB, mem_fraction=1.0, matmul_flops=76.8e9,
        attention_flops=45.0e9, weight_read_Bps=16.0e9, kv_read_Bps=16.0e9,
        all_gather=CollectiveCost(0.166e-3, 100e6), all_to_all=CollectiveCost(0.308e-3, 513e6),
        all_reduce=CollectiveCost(9.12e-6, 84.1e6), step_overhead_s=3.18e-3, layer_overhead_s=0.700e-3,
        engine="cpu", request_layer_s=1.55e-6, request_step_s=0.169e-3, score_element_s=6.34e-9,
        expert_call_s=0.0),
    # The same machine running the reference ``torch`` attention backend over gloo (the engine before
    # its native kernels): fitted to 128 engine steps (median error 7.8 %; held-out grid 10.7 %).
    "cpu-torch": HardwareProfile(
        name="cpu-torch", world_size=2, memory_bytes=1 * GiB, mem_fraction=1.0, matmul_flops=41.3e9,
        attention_flops=25.9e9, weight_read_Bps=19.4e9, kv_read_Bps=19.4e9,
        all_gather=CollectiveCost(1.43e-3, 71.1e6), all_to_all=CollectiveCost(0.82e-3, 273e6),
        all_reduce=CollectiveCost(2.05e-3, 218e6), step_overhead_s=2.82e-3, layer_overhead_s=21.9e-6,
        engine="torch_ref", request_layer_s=0.324e-3, request_step_s=0.272e-3, score_element_s=2.63e-9,
        expert_call_s=0.145e-3),
}


FITTED_PRESETS = ("b200-paper", "h200-paper", "dcu-paper")
"""Profiles fitted to the published sweeps of each platform (``python -m splash_rollout.sim fit`` over
all of a platform's sweeps): the prefill group of ``presets/<platform>.yaml``."""


def load_profile(source: str | os.PathLike | HardwareProfile) -> HardwareProfile:
    """A preset name (spec presets, or the fitted ``<platform>-paper``), a YAML file written by
    ``save_profile``, or a profile → HardwareProfile."""
    if isinstance(source, HardwareProfile):
        return source
    key = os.fspath(source)
    if key.lower() in PRESETS:
        return PRESETS[key.lower()]
    if key.lower() in FITTED_PRESETS:
        path = os.path.join(os.path.dirname(__file__), "presets", key.lower().split("-")[0] + ".yaml")
        with open(path) as f:
            return HardwareProfile.from_dict(yaml.safe_load(f)["profile"], source=f"preset {key!r}")
    if not os.path.isfile(key):
        raise ValueError(f"hardware: unknown preset or file {key!r}; presets are "
                         f"{sorted(PRESETS) + list(FITTED_PRESETS)}")
    try:
        with open(key) as f:
            raw = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ValueError(f"hardware: {key!r} is not valid YAML ({str(e).splitlines()[0]})") from None
    return HardwareProfile.from_dict(raw, source=f"hardware {key!r}")


def save_profile(profile: HardwareProfile, path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(profile.to_dict(), f, sort_keys=False)
