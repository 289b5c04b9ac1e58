"""Prompt sharing, expected-growth admission and retraction on one rank: under a pool small enough
to force retractions, every sample comes back once with the tokens and logprobs of an unshared,
unpressured run; a prompt is prefilled once per group; every page and reference is freed."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from splash_rollout.scheduling.admission import AdmissionSettings
from splash_rollout.engine.rank_engine import Engine
from splash_rollout.rollout.build import engine_settings
from splash_rollout.rollout.config import EngineConfig
from splash_rollout.engine.request import Request, SamplingSpec
from splash_rollout.models.config import PRESETS
from splash_rollout.models.model import MLAForCausalLM
from splash_rollout.models.numerics import numerics_mode, set_numerics
from tests.rollout_checks import assert_only_cache_holds_pages

CFG = PRESETS["glm5-nano"].replace(index_topk=24)
PAGE = 8


@pytest.fixture(scope="module")
def model_state():
    before = numerics_mode()
    set_numerics("reproducible")
    yield MLAForCausalLM.from_config(CFG, seed=3).eval().state_dict()
    set_numerics(before)


def _engine(state, max_num_batched_tokens: int = 64, **memory) -> Engine:
    """One rank, 64 requests at most, speculation off; ``memory``: memory fields over 512 pages of PAGE."""
    model = MLAForCausalLM.from_config(CFG, seed=3).eval()
    model.load_state_dict(state)
    config = EngineConfig(model=CFG, memory=dict(dict(num_pages=512, page_size=PAGE), **memory),
                          batching=dict(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=64),
                          compute=dict(speculation="off"))
    return Engine.single(model, CFG, engine_settings(config))


def _requests(groups, temperature: float) -> list[Request]:
    g = torch.Generator().manual_seed(11)
    reqs = []
    for gi, (prompt_len, n, max_new) in enumerate(groups):
        prompt = torch.randint(3, CFG.vocab_size, (prompt_len,), generator=g).tolist()
        for j in range(n):
            spec = SamplingSpec(temperature=temperature, max_new_tokens=max_new + (j * 5) % 7, ignore_eos=True,
                                seed=1000 * gi + j)
            reqs.append(Request(len(reqs), prompt, spec, CFG.max_position_embeddings, CFG.eos_token_ids))
    return reqs


def _outputs(finished):
    return {r.request_id: (r.output_ids, r.output_logprobs, r.finish_reason) for r in finished}


def _assert_nothing_held(engine: Engine) -> None:
    assert_only_cache_holds_pages(engine.scheduler.placement.managers)
    assert engine.block_table.num_rows_in_use == 0


@pytest.fixture(scope="module")
def oracle_engine(model_state):
    return _engine(model_state, admission="worst_case", prefix_sharing=False)


@pytest.fixture(scope="module")
def pressured_engine(model_state):
    return _engine(model_state, num_pages=14, max_num_batched_tokens=48)


groups_strategy = st.lists(st.tuples(st.integers(1, 40), st.sampled_from([1, 2, 8]), st.integers(1, 20)),
                           min_size=1, max_size=4)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(groups=groups_strategy, temperature=st.sampled_from([0.0, 1.0]))
def test_pressured_shared_run_equals_the_unshared_unpressured_run(oracle_engine, pressured_engine, groups, temperature):
    want = _outputs(oracle_engine.serve(_requests(groups, temperature)))
    got = _outputs(pressured_engine.serve(_requests(groups, temperature)))
    assert sorted(got) == sorted(want)
    for rid in want:
        assert got[rid] == want[rid], f"request {rid}"
    _assert_nothing_held(pressured_engine)
    _assert_nothing_held(oracle_engine)


def test_a_prompt_is_prefilled_once_per_group(model_state):
    engine = _engine(model_state)
    groups = [(37, 8, 6), (16, 8, 6), (5, 2, 6), (23, 1, 6)]
    finished = engine.serve(_requests(groups, 1.0))
    assert len(finished) == 19
    prefill = sum(s.prefill_rows for s in engine.step_log)
    assert prefill == 37 + 16 + 5 + 23  # distinct prompts, not samples
    assert sum(s.forks for s in engine.step_log) == 7 + 7 + 1
    assert sum(s.prefix_hit_tokens for s in engine.step_log) == 7 * 37 + 7 * 16 + 5
    _assert_nothing_held(engine)


def test_a_group_holds_its_prompt_pages_once(model_state):
    engine = _engine(model_state)
    engine.serve(_requests([(37, 8, 30)], 1.0), max_steps=2)  # the prompt prefilled, then one decode
    manager = engine.scheduler.placement.managers[0]
    # 4 full prompt pages shared by 8 samples; the partly filled 5th: the leader's and 7 copies
    assert manager.num_used == 4 + 1 + 7 and manager.num_references == 8 * 4 + 8
    engine.abort_all()
    _assert_nothing_held(engine)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_retracted_samples_continue_as_if_never_retracted(model_state, oracle_engine, temperature):
    engine = _engine(model_state, num_pages=10, max_num_batched_tokens=48,
                     init_growth_ratio=0.1, min_growth_ratio=0.05)
    groups = [(12, 1, 40), (12, 1, 40), (12, 2, 40)]
    finished = engine.serve(_requests(groups, temperature))
    assert _outputs(finished) == _outputs(oracle_engine.serve(_requests(groups, temperature)))
    assert sum(s.retracted for s in engine.step_log) >= 1
    assert sum(r.num_retractions for r in finished) >= 1
    _assert_nothing_held(engine)


def test_worst_case_admission_never_retracts(model_state):
    engine = _engine(model_state, num_pages=10, max_num_batched_tokens=48,
                     admission="worst_case")
    finished = engine.serve(_requests([(12, 1, 40), (12, 1, 40), (12, 1, 40)], 0.0))
    assert len(finished) == 3 and sum(s.retracted for s in engine.step_log) == 0
    assert max(s.running for s in engine.step_log) == 1  # 52 tokens = 7 of 10 pages each
    _assert_nothing_held(engine)


def test_bad_admission_settings_name_the_field():
    with pytest.raises(ValueError, match="admission.mode"):
        AdmissionSettings(mode="greedy")
    with pytest.raises(ValueError, match="min_ratio"):
        AdmissionSettings(init_ratio=0.1, min_ratio=0.5)
    with pytest.raises(ValueError, match="memory.init_growth_ratio: expected 0 <= min_growth_ratio"):
        EngineConfig(memory={"init_growth_ratio": 0.1, "min_growth_ratio": 0.5})
