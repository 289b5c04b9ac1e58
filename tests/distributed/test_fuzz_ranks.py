"""Fuzz of the public surface on a 2-rank spawned engine (tests/fuzz_surface.py), one engine for the
module: every call succeeds with well-formed samples or raises an error naming a field, and after
each sequence the ranks still answer a fixed call exactly as before."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from splash_rollout import EngineConfig, RolloutEngine
from splash_rollout.rollout.build import whole_model
from tests.fuzz_surface import PROBE, operations, run_operations

CFG = EngineConfig(model="glm5-nano", world_size=2, layout="dp", page_size=8, max_num_batched_tokens=64,
                   memory_budget_gib=0.005, max_model_len=16, max_queued_requests=8)


@pytest.fixture(scope="module")
def fuzzed():
    weights = whole_model(CFG).state_dict()  # the ranks' full weights (same seed)
    with RolloutEngine(CFG) as eng:
        yield eng, weights, [s.response_ids for s in eng.generate(*PROBE).samples]


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(ops=operations)
def test_public_surface_fuzz_two_ranks(fuzzed, ops):
    engine, weights, probe = fuzzed
    run_operations(engine, ops, weights, probe)
    assert engine._broken is None
