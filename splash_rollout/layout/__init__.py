"""The ownership model (pure): layouts, byte accounting, footprints, fit rules, capacity limits and
switch plans. numpy only; no torch, no torch.distributed. Paper §2, Table 2, Table 3, Appendix B."""
from splash_rollout.layout.arith import GiB, MiB, ceil_div, div_even
from splash_rollout.layout.bytes import KV_FORMATS, WEIGHT_DTYPES, AttentionBytes
from splash_rollout.layout.fit import fits, rank_demand, round_robin_owners
from splash_rollout.layout.footprint import (FEED_FORWARD_PLACEMENTS, VOCAB_PLACEMENTS, LayoutFootprint, RankBudget,
                                             attention_weight_bytes_per_rank, footprint, footprints,
                                             other_weight_bytes_per_rank, pool_tokens)
from splash_rollout.layout.layouts import ALL_LAYOUTS, Layout, Ownership, Placement
from splash_rollout.layout.limits import CohortSpec, longest_feasible_input, longest_feasible_inputs
from splash_rollout.layout.switch_plan import (BatchKV, LayerPlan, Primitive, StateMove, SwitchPlan,
                                               all_switches, kv_primitive, weight_primitive)

__all__ = [
    "ALL_LAYOUTS", "AttentionBytes", "BatchKV", "CohortSpec", "FEED_FORWARD_PLACEMENTS", "GiB", "KV_FORMATS",
    "LayerPlan", "Layout", "LayoutFootprint", "MiB", "Ownership", "Placement", "Primitive", "RankBudget", "StateMove",
    "SwitchPlan", "VOCAB_PLACEMENTS", "WEIGHT_DTYPES", "all_switches", "attention_weight_bytes_per_rank", "ceil_div",
    "div_even", "fits", "footprint",
    "footprints", "kv_primitive", "longest_feasible_input", "longest_feasible_inputs",
    "other_weight_bytes_per_rank", "pool_tokens", "rank_demand", "round_robin_owners", "weight_primitive",
]
