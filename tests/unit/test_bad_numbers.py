"""Bad numbers never poison a rollout (one rank): a push with NaN/inf, a shard, a placeholder or a
lossy dtype is refused before any weight changes; logits that are not finite end only the affected
samples, with finish_reason "error" and no token drawn; the context caps max_new_tokens."""
from __future__ import annotations

import math

import pytest
import torch

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams
from tests.rollout_checks import assert_only_cache_holds_pages

CFG = dict(model="glm5-nano", num_pages=32, page_size=4, max_model_len=32, max_num_batched_tokens=32)
GREEDY = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)
SAMPLED = SamplingParams(n=2, max_new_tokens=5, ignore_eos=True, seed=3)
EMBED = "model.embed_tokens.weight"
POISON = 77  # the token id whose embedding row becomes NaN


def _tokens(batch):
    return [s.response_ids for s in batch.samples]


@pytest.fixture(scope="module")
def eng():
    with RolloutEngine(EngineConfig(**CFG)) as e:
        yield e


def _weights(eng):
    return {n: t.clone() for n, t in eng.model.state_dict().items()}


def _unchanged(eng, old):
    return all(torch.equal(t, old[n]) for n, t in eng.model.state_dict().items())


def test_a_nan_push_is_refused_naming_the_tensor_and_count_and_the_old_weights_serve(eng):
    before, old = _tokens(eng.generate([[5, 6, 7]], GREEDY)), _weights(eng)
    bad = {n: t + 0.01 for n, t in old.items() if t.is_floating_point()}
    name = "model.layers.1.self_attn.o_proj.weight"
    bad[name] = bad[name].clone()
    bad[name][0, :3] = float("nan")
    bad[name][2, 1] = float("-inf")
    with pytest.raises(ValueError, match=rf"update_weights: {name}: 4 of its {bad[name].numel()} values are NaN or "
                                         rf"infinite .*nothing was updated"):
        eng.update_weights(bad, version=3)
    assert _unchanged(eng, old) and eng.weight_version == 0
    assert _tokens(eng.generate([[5, 6, 7]], GREEDY)) == before


def test_exact_casts_are_accepted_lossy_ones_are_not(eng):
    old = _weights(eng)
    try:
        as_bf16 = {EMBED: old[EMBED].bfloat16()}  # every bfloat16 is a float32
        eng.update_weights(as_bf16)
        assert torch.equal(eng.model.state_dict()[EMBED], as_bf16[EMBED].float())
        eng.update_weights({EMBED: old[EMBED].double()})  # float32 values held in float64: exact
        assert torch.equal(eng.model.state_dict()[EMBED], old[EMBED])
        with pytest.raises(ValueError, match=rf"{EMBED}: expected dtype torch.float32, got torch.float64, and \d+ of"):
            eng.update_weights({EMBED: old[EMBED].double() * (1 + 1e-12)})
        with pytest.raises(ValueError, match=rf"{EMBED}: expected dtype torch.float32, got torch.int64, and \d+ of"):
            eng.update_weights({EMBED: (old[EMBED] * 100).long() + 2**40})
    finally:
        eng.update_weights({EMBED: old[EMBED]})
    assert _unchanged(eng, old)


def test_partial_pushes_are_refused(eng):
    old = _weights(eng)
    name = "model.layers.0.self_attn.q_b_proj.weight"
    full = old[name]
    cases = [
        ({name: full[:, : full.shape[1] // 4]}, rf"{name}: has shape .* 1/4 of the full .* along dim 1: a shard"),
        ({name: torch.empty(0)}, rf"{name}: is empty .*ZeRO-3 partitioned parameter"),
        ({name: torch.empty(full.shape, device="meta")}, rf"{name}: is on the meta device"),
    ]
    for push, message in cases:
        with pytest.raises(ValueError, match=message):
            eng.update_weights({**{n: t for n, t in old.items() if n != name}, **push})
        assert _unchanged(eng, old)


def test_non_finite_logits_end_only_the_affected_samples_with_error(eng):
    clean_prompt, poisoned_prompt = [5, 6, 7, 8], [9, POISON, 10]
    want = _tokens(eng.generate([clean_prompt], SAMPLED))
    old = _weights(eng)
    poisoned = old[EMBED].clone()
    poisoned[POISON] = float("nan")
    eng.update_weights({EMBED: poisoned}, version=1, check_finite=False)  # the check is what stops this
    try:
        batch = eng.generate([clean_prompt, poisoned_prompt, [POISON]], SAMPLED)
    finally:
        eng.update_weights({EMBED: old[EMBED]}, version=2)
    clean, *bad = batch.groups
    assert [s.response_ids for s in clean.samples] == want  # the other samples are unaffected
    assert all(s.finish_reason == "length" for s in clean.samples)
    for g in bad:
        for s in g.samples:
            assert s.finish_reason == "error" and s.response_ids == [] and s.response_logprobs == []
    assert all(math.isfinite(lp) for s in batch.samples for lp in s.response_logprobs)
    assert_only_cache_holds_pages(eng.local_engine.scheduler.placement.managers)  # refused samples gave theirs back
    assert _tokens(eng.generate([clean_prompt], SAMPLED)) == want  # and the engine serves on


def test_max_new_tokens_beyond_the_context_is_capped_with_length(eng):
    batch = eng.generate([[3] * 28, [4] * 5], SamplingParams(max_new_tokens=10**9, ignore_eos=True, seed=1))
    short, longer = batch.samples
    assert short.finish_reason == "length" and len(short.prompt_ids) + len(short.response_ids) == 32
    assert longer.finish_reason == "length" and len(longer.response_ids) == 32 - 5


def test_the_queue_bound_is_stated_and_default_sane(eng):
    assert 1024 <= EngineConfig().batching.max_queued_requests <= 10**6
    with pytest.raises(ValueError, match=r"1 prompts x n ask for 10000000 samples, more than "
                                         r"EngineConfig.batching.max_queued_requests=65536"):
        eng.generate([[3]], SamplingParams(n=10_000_000))
    assert not eng.local_engine.scheduler.has_unfinished
