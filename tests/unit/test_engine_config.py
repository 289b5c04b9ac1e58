"""EngineConfig: one frozen config grouped by concern, built from groups, mappings or (this release)
the flat names of earlier releases, and the recipe's Hydra engine group reaching every group."""
from __future__ import annotations

import dataclasses
import os
import pickle

import pytest

from splash_rollout.engine.layout_driver import DriverConfig
from splash_rollout.layout.layouts import Layout
from splash_rollout.rollout.config import FLAT_NAMES, GROUPS, EngineConfig
from splash_rollout.engine.options import MemoryOptions, ParallelOptions
from splash_rollout.rollout.model_options import ModelOptions
from splash_rollout.scheduling.policy import PolicyConfig


def test_groups_from_instances_mappings_and_a_bare_model_name():
    config = EngineConfig(model="glm5-nano", parallel=ParallelOptions(world_size=2, layout="auto"),
                          memory={"page_size": 8, "admission": "worst_case"}, policy={"min_dwell_steps": 8})
    assert config.model == ModelOptions(source="glm5-nano")
    assert (config.parallel.world_size, config.parallel.layout, config.parallel.auto) == (2, "auto", True)
    assert config.memory == MemoryOptions(page_size=8, admission="worst_case")
    assert config.policy == PolicyConfig(min_dwell_steps=8)
    assert config.driver == DriverConfig()  # an omitted group is its defaults
    assert pickle.loads(pickle.dumps(config)) == config  # ranks receive it pickled
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.parallel = ParallelOptions()


def test_flat_names_land_in_their_groups_and_match_the_grouped_form():
    flat = EngineConfig(model="glm5-nano", world_size=2, layout="dp", page_size=8, numerics="reproducible",
                        max_num_seqs=4, profile="cpu-torch", progress=False)
    grouped = EngineConfig(model="glm5-nano", parallel={"world_size": 2, "layout": "dp"}, memory={"page_size": 8},
                           compute={"numerics": "reproducible"}, batching={"max_num_seqs": 4},
                           pricing={"profile": "cpu-torch"}, outputs={"progress": False})
    assert flat == grouped
    assert flat.replace(world_size=4).parallel.world_size == 4
    assert flat.replace(memory={"page_size": 32}).memory.page_size == 32
    for name, (group, field) in FLAT_NAMES.items():  # every flat name is a field of the group it names
        assert group in GROUPS and field in {f.name for f in dataclasses.fields(GROUPS[group])}, name


@pytest.mark.parametrize("kwargs, error, match", [
    ({"memory": {"page_size": 0}}, ValueError, r"memory\.page_size: expected >= 1"),
    ({"page_size": 0}, ValueError, r"memory\.page_size: expected >= 1"),
    ({"memory": {"page_sz": 8}}, ValueError, r"memory: unknown field\(s\) \['page_sz'\]"),
    ({"parallel": {"layout": "ring"}}, ValueError, "layout"),
    ({"policy": {"decide_every_steps": 4}}, ValueError, r"policy\.decide_every_steps: moved to the driver"),
    ({"compute": "fast"}, TypeError, r"compute: expected a ComputeOptions"),
    ({"worldsize": 2}, TypeError, r"unknown option\(s\) \['worldsize'\]"),
    ({"attention_backend": "flashmla"}, ValueError, r"FlashMLA reads bfloat16 pages of 64 tokens"),
    ({"max_queued_requests": True}, ValueError, r"batching\.max_queued_requests: expected an integer"),
    ({"compute": {"retain_heap": "yes"}}, ValueError, r"compute\.retain_heap: expected True or False"),
    ({"compute": {"pack_weights": 1}}, ValueError, r"compute\.pack_weights: expected True or False"),
    ({"parallel": {"feed_forward": "split"}}, ValueError, r"parallel\.feed_forward: expected one of"),
    ({"parallel": {"world_size": 2, "feed_forward": "replicated"}, "outputs": {"return_routing": True}}, ValueError,
     r"return_routing needs feed_forward='sharded' on more than one rank"),
    ({"compute": {"decode_buckets": 8}}, ValueError, r"compute\.decode_buckets: expected increasing positive"),
    ({"compute": {"decode_buckets": [4, 2]}}, ValueError, r"compute\.decode_buckets: expected increasing positive"),
    ({"memory": {"init_growth_ratio": "x"}}, ValueError, r"memory\.init_growth_ratio: expected a number in \[0, 1\]"),
    ({"memory": {"min_growth_ratio": 0.9}}, ValueError, r"memory\.init_growth_ratio: expected 0 <= min_growth_ratio"),
    ({"compute": {"max_draft_tokens": True}}, ValueError, r"compute\.max_draft_tokens: expected None or an integer"),
])
def test_bad_options_are_refused_naming_the_group_and_field(kwargs, error, match):
    with pytest.raises(error, match=match):
        EngineConfig(**kwargs)


def test_the_recipe_engine_group_reaches_every_group(monkeypatch):
    from omegaconf import OmegaConf

    import splash_rollout.recipes.grpo.build as build
    import splash_rollout.rollout.engine as engine_module
    from splash_rollout.run import compose_config

    cfg = compose_config(["+recipe=grpo_glm5", "engine.parallel.world_size=1", "engine.parallel.layout=dp",
                          "engine.memory.admission=worst_case", "engine.batching.max_num_seqs=3",
                          "engine.policy.min_dwell_steps=5", "engine.driver.decide_every_steps=7",
                          "engine.pricing.online_correction=false", "engine.compute.cpu_share=false",
                          "engine.outputs.progress=false"])
    assert set(GROUPS) <= set(OmegaConf.to_container(cfg.engine))
    seen = {}
    monkeypatch.setattr(engine_module, "RolloutEngine", lambda config: seen.setdefault("config", config))
    build.build_engine(cfg)
    config = seen["config"]
    assert (config.parallel.world_size, config.parallel.layout) == (1, "dp")
    assert config.memory.admission == "worst_case" and config.memory.memory_budget_gib == 0.006  # the recipe's
    assert config.batching.max_num_seqs == 3
    assert config.policy.min_dwell_steps == 5 and config.driver.decide_every_steps == 7
    assert config.pricing.online_correction is False and config.compute.cpu_share is False
    assert config.outputs.progress is False and config.compute.numerics == "reproducible"
    assert config.model.seed == cfg.seed and Layout.parse(config.parallel.layout) is Layout.DP


def test_the_heap_settings_are_taken_by_this_machines_malloc():
    """CI and the project's machines run glibc: every mallopt setting of ``retain_heap`` is accepted
    (a value glibc refuses -- an mmap threshold above its 32 MiB cap -- would make it False)."""
    from splash_rollout.rollout.process_settings import HEAP_SETTINGS, retain_heap

    assert retain_heap()
    assert dict(HEAP_SETTINGS)[-3] <= 32 << 20


def test_the_hydra_engine_tree_is_made_from_the_groups_and_restates_no_default():
    """Every field of every group is settable on the command line (the node ``engine/fields`` is made
    from the dataclasses), a misspelt one is refused, and ``conf/engine/default.yaml`` holds only
    values that differ from the engine's own defaults."""

    import yaml
    from hydra.errors import ConfigCompositionException

    from splash_rollout.recipes.engine_config import FROM_OTHER_GROUPS, engine_fields
    from splash_rollout.run import CONF_DIR, compose_config

    fields = engine_fields()
    for name, cls in GROUPS.items():
        assert set(fields[name]) == {f.name for f in dataclasses.fields(cls)} - set(FROM_OTHER_GROUPS.get(name, ()))
    cfg = compose_config(["engine.memory.init_growth_ratio=0.3", "engine.compute.pack_weights=false"])
    assert cfg.engine.memory.init_growth_ratio == 0.3 and cfg.engine.compute.pack_weights is False
    with pytest.raises(ConfigCompositionException, match="cpu_shares"):
        compose_config(["engine.compute.cpu_shares=false"])
    with open(os.path.join(CONF_DIR, "engine", "default.yaml")) as f:
        chosen = yaml.safe_load(f)
    for group in GROUPS:
        for name, value in (chosen.get(group) or {}).items():
            assert value != fields[group][name], f"default.yaml restates engine.{group}.{name}: {value!r}"


def test_the_server_entry_explains_itself_and_prints_its_composed_config(capsys):
    """``python -m splash_rollout.serve --help`` prints its usage and ``--cfg`` the composed config
    (every engine field, with the overrides), neither starting an engine."""
    from splash_rollout.serve.__main__ import main

    main(["--help"])
    assert "python -m splash_rollout.serve [overrides]" in capsys.readouterr().out
    main(["--cfg", "serve.port=8123", "engine.compute.max_draft_tokens=3"])
    shown = capsys.readouterr().out
    assert "port: 8123" in shown and "max_draft_tokens: 3" in shown and "init_growth_ratio: 0.7" in shown
