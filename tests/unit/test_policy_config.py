"""The layout policy's knobs reach the policy the engine builds, and the driver's cadence the driver:
from EngineConfig (a PolicyConfig / DriverConfig or a mapping of its fields) and from Hydra's
``engine.policy.*`` / ``engine.driver.*``; a wrong name or value is refused naming the field."""
import pytest
import torch
from omegaconf import OmegaConf

from splash_rollout.engine.layout_driver import DriverConfig
from splash_rollout.layout import Layout
from splash_rollout.models.config import resolve_model
from splash_rollout.rollout.config import EngineConfig
from splash_rollout.rollout.build import make_policy
from splash_rollout.run import compose_config
from splash_rollout.scheduling.policy import PolicyConfig


def _policy_of(config: EngineConfig):
    return make_policy(config, resolve_model("glm5-nano"), 2, 8 << 20, torch.float32)


def test_engine_config_policy_reaches_the_policy():
    assert _policy_of(EngineConfig(layout="auto")).config == PolicyConfig()
    policy = _policy_of(EngineConfig(layout="auto", policy={"min_dwell_steps": 8, "layouts": ["dp", "DOP"],
                                                            "dwell_break_factor": None}))
    assert policy.config.min_dwell_steps == 8
    assert policy.config.layouts == (Layout.DP, Layout.DOP)
    assert policy.config.dwell_break_factor == PolicyConfig().dwell_break_factor  # None: the default
    given = PolicyConfig(min_dwell_steps=4)
    assert _policy_of(EngineConfig(layout="auto", policy=given)).config is given


def test_hydra_overrides_reach_engine_config():
    cfg = compose_config(["+recipe=grpo_glm5", "engine.policy.min_dwell_steps=5", "engine.policy.rel_margin=0.1",
                          "engine.driver.decide_every_steps=4"])
    config = EngineConfig(policy=OmegaConf.to_container(cfg.engine.policy),
                          driver=OmegaConf.to_container(cfg.engine.driver))
    assert (config.policy.min_dwell_steps, config.policy.rel_margin) == (5, 0.1)
    assert config.policy.horizon_quantile == PolicyConfig().horizon_quantile
    assert config.driver == DriverConfig(decide_every_steps=4)


@pytest.mark.parametrize("bad,message", [
    ({"min_dwel_steps": 3}, r"policy: unknown field\(s\) \['min_dwel_steps'\]"),
    ({"dwell_break_factor": 0.5}, r"policy\.dwell_break_factor: expected a number >= 1, got 0.5"),
    ({"decide_every_steps": 8}, r"policy\.decide_every_steps: moved to the driver's config \(engine\.driver"),
    ({"layouts": ["dp", "xx"]}, r"policy\.layouts: unknown layout 'xx'"),
    (7, r"policy: expected a PolicyConfig or a mapping"),
])
def test_a_bad_policy_names_the_field(bad, message):
    with pytest.raises((ValueError, TypeError), match=message):
        EngineConfig(policy=bad)


def test_engine_config_driver_reaches_the_engine_settings():
    from splash_rollout.rollout.build import engine_settings

    model = resolve_model("glm5-nano")
    assert engine_settings(EngineConfig(layout="auto", world_size=2), model, 2).driver == DriverConfig()
    settings = engine_settings(EngineConfig(layout="auto", world_size=2, driver={"observe_every_steps": 2}), model, 2)
    assert settings.driver == DriverConfig(observe_every_steps=2)


@pytest.mark.parametrize("bad,message", [
    ({"decide_every_steps": 0}, r"driver\.decide_every_steps: expected a positive integer, got 0"),
    ({"decide_batch_fraction": 1.5}, r"driver\.decide_batch_fraction: expected a value in \(0, 1\]"),
    ({"min_dwell_steps": 3}, r"driver: unknown field\(s\) \['min_dwell_steps'\]"),
])
def test_a_bad_driver_config_names_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(driver=bad)
