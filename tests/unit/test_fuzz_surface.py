"""Fuzz of the public surface on one rank (tests/fuzz_surface.py): random SamplingParams, prompts and
sequences of generate / update_weights / sleep / wake_up / abort; every call succeeds with
well-formed samples or raises an error naming a field, and the engine stays usable."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from splash_rollout import EngineConfig, RolloutEngine
from tests.fuzz_surface import PROBE, operations, run_operations
from tests.rollout_checks import assert_only_cache_holds_pages

CFG = dict(model="glm5-nano", num_pages=64, page_size=4, max_model_len=16, max_num_batched_tokens=32,
           max_queued_requests=8)


@pytest.fixture(scope="module")
def fuzzed():
    with RolloutEngine(EngineConfig(**CFG)) as eng:
        weights = {n: t.clone() for n, t in eng.model.state_dict().items()}
        yield eng, weights, [s.response_ids for s in eng.generate(*PROBE).samples]


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(ops=operations)
def test_public_surface_fuzz_one_rank(fuzzed, ops):
    engine, weights, probe = fuzzed
    run_operations(engine, ops, weights, probe)
    assert_only_cache_holds_pages(engine.local_engine.scheduler.placement.managers)
    assert not engine.local_engine.scheduler.has_unfinished
