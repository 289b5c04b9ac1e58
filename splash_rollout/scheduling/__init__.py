"""Scheduling (pure): hardware profile θ, cost model t_ℓ(x; θ), switch cost, policy π, owner choice,
admission's growth estimate. numpy / pyyaml only; imports models.config and layout only."""
from splash_rollout.scheduling.cost_model import STAGES, StepBatch, StepCost, layout_fits, step_time, step_times
from splash_rollout.scheduling.deployment import Deployment
from splash_rollout.scheduling.admission_plan import Waiting, choose_owner
from splash_rollout.scheduling.policy import Decision, DecisionRule, LayoutPolicy, PolicyConfig
from splash_rollout.scheduling.profile import (PRESETS, CollectiveCost, HardwareProfile, load_profile,
                                               save_profile)
from splash_rollout.scheduling.switch_cost import (SwitchCost, layer_transfer_seconds, overlapped_seconds,
                                                   switch_cost)

__all__ = [
    "CollectiveCost", "Decision", "DecisionRule", "Deployment", "HardwareProfile", "LayoutPolicy", "PRESETS", "PolicyConfig",
    "STAGES", "StepBatch", "StepCost", "SwitchCost", "Waiting", "choose_owner", "layer_transfer_seconds", "layout_fits",
    "load_profile", "overlapped_seconds", "save_profile", "step_time", "step_times", "switch_cost",
]
