"""Partial rollout: samples cut off mid-call keep their tokens, logprobs and per-token weight
versions, and ``resume`` continues them -- exactly as an uninterrupted sample would go on under the
same weights, and under new weights with the new model's tokens; a staleness bound drops old ones."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams
from splash_rollout.models.config import PRESETS
from splash_rollout.models.model import MLAForCausalLM

PROMPTS = [[5, 6, 7, 8] * 4, [9, 10, 11], [12] * 21, [3, 4] * 9]
CFG = dict(model="glm5-nano", num_pages=256, page_size=8, max_num_batched_tokens=64, numerics="reproducible")


def _per_prompt(params: SamplingParams) -> list[SamplingParams]:
    """The first prompt's group is short: it finishes while the others are mid-response."""
    return [dataclasses.replace(params, max_new_tokens=4)] + [params] * (len(PROMPTS) - 1)


def _cut(engine: RolloutEngine, params: SamplingParams):
    """A streaming call stopped once one group is done: the others come back aborted mid-response."""
    batch = engine.generate(PROMPTS, _per_prompt(params), target_groups=1)
    partial = [s for g in batch.aborted for s in g.samples if s.finish_reason == "abort"]
    assert partial and all(0 < len(s.response_ids) < params.max_new_tokens for s in partial)
    return partial


@pytest.mark.parametrize("temperature, speculation, draft",
                         [(0.0, "off", "auto"), (1.0, "off", "auto"), (1.0, "always", "ngram"), (1.0, "always", "mtp")])
def test_a_resumed_sample_is_the_uninterrupted_one(temperature, speculation, draft):
    params = SamplingParams(n=2, temperature=temperature, max_new_tokens=24, ignore_eos=True, seed=4)
    with RolloutEngine(EngineConfig(**CFG, speculation=speculation, draft=draft)) as engine:
        whole = {(tuple(s.prompt_ids), s.seed): s for s in engine.generate(PROMPTS, _per_prompt(params)).samples}
        partial = _cut(engine, params)
        done = engine.resume(partial)
    assert len(done.samples) == len(partial)
    for before, after in zip(partial, done.samples):
        want = whole[(tuple(before.prompt_ids), before.seed)]
        assert after.response_ids[: len(before.response_ids)] == before.response_ids
        assert after.response_ids == want.response_ids and after.response_logprobs == want.response_logprobs
        assert after.finish_reason == "length" and after.token_versions == [0] * len(after.response_ids)


def test_resumed_under_new_weights_continues_with_the_new_model_and_records_versions():
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=20, ignore_eos=True, seed=2)
    new = MLAForCausalLM.from_config(PRESETS["glm5-nano"], seed=9).eval()
    with RolloutEngine(EngineConfig(**CFG)) as engine:
        partial = _cut(engine, params)
        engine.update_weights(new.state_dict(), version=1)
        done = engine.resume(partial)
    for before, after in zip(partial, done.samples):
        k = len(before.response_ids)
        assert after.response_ids[:k] == before.response_ids and after.response_logprobs[:k] == before.response_logprobs
        assert after.token_versions == [0] * k + [1] * (len(after.response_ids) - k)
        # the continuation is the new model's greedy choice after the whole history, token by token
        ids = torch.tensor([after.prompt_ids + after.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(new(ids).float(), -1)[0]
        p = len(after.prompt_ids)
        for j in range(k, len(after.response_ids)):
            row = logp[p + j - 1]
            assert after.response_ids[j] == int(row.argmax())
            assert abs(after.response_logprobs[j] - float(row[after.response_ids[j]])) < 1e-4


def test_staleness_bound_drops_old_samples_and_bad_input_is_refused():
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=20, ignore_eos=True, seed=2)
    with RolloutEngine(EngineConfig(**CFG)) as engine:
        partial = _cut(engine, params)
        weights = MLAForCausalLM.from_config(PRESETS["glm5-nano"], seed=0).state_dict()
        engine.update_weights(weights, version=1)
        engine.update_weights(weights, version=2)
        kept = engine.resume(partial, max_off_policy_steps=2)
        assert len(kept.samples) == len(partial) and not kept.dropped
        engine.update_weights(weights, version=3)
        late = engine.resume(partial, max_off_policy_steps=2)
        assert late.samples == [] and late.dropped == partial and late.metrics["rollout/stale_dropped"] == len(partial)
        with pytest.raises(ValueError, match=r"samples\[0\]: finish_reason 'length'"):
            engine.resume(kept.samples)
        with pytest.raises(ValueError, match="max_off_policy_steps"):
            engine.resume(partial, max_off_policy_steps=-1)


def test_multi_turn_continuation_masks_the_environment_and_equals_a_fresh_call():
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=5)
    with RolloutEngine(EngineConfig(**CFG)) as engine:
        first = engine.generate(PROMPTS[:2], SamplingParams(temperature=1.0, max_new_tokens=5, seed=1)).samples
        reply = [[40, 41, 42], [43]]  # what a tool answered
        turn = engine.continue_samples(first, reply, params)
        fresh = engine.generate([s.prompt_ids + s.response_ids + r for s, r in zip(first, reply)], params)
    assert [len(g.samples) for g in turn.groups] == [2, 2]
    for g, f, s, r in zip(turn.groups, fresh.groups, first, reply):
        for got, want in zip(g.samples, f.samples):
            k, a = len(s.response_ids), len(r)
            assert got.prompt_ids == s.prompt_ids
            assert got.response_ids == s.response_ids + r + want.response_ids
            assert got.loss_mask == [1] * k + [0] * a + [1] * len(want.response_ids)
            assert got.response_logprobs[k + a:] == want.response_logprobs and got.response_logprobs[k:k + a] == [0.0] * a
    with pytest.raises(ValueError, match="appended: expected one token list per sample"):
        engine_args = EngineConfig(**CFG)
        with RolloutEngine(engine_args) as engine:
            engine.continue_samples(first, [[1]], params)


def test_one_call_finishes_carried_groups_under_new_weights_and_generates_new_prompts():
    """generate(prompts, resume=groups): the carried groups' finished samples come back as they were,
    their aborted ones continue exactly as resume() continues them (the new model's tokens, per-token
    versions), and the carried groups are the call's first groups, judged while streaming."""
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=20, ignore_eos=True, seed=2)
    new = MLAForCausalLM.from_config(PRESETS["glm5-nano"], seed=9).eval()
    fresh = [[7, 8, 9], [10, 11] * 3]
    with RolloutEngine(EngineConfig(**CFG)) as engine:
        cut = engine.generate(PROMPTS, _per_prompt(params), target_groups=1)
        carried = cut.aborted
        engine.update_weights(new.state_dict(), version=1)
        alone = engine.resume([s for g in carried for s in g.samples if s.finish_reason == "abort"])
        seen = []
        both = engine.generate(fresh, params, resume=carried, on_group=lambda g: seen.append(g.prompt_index) or True)
        only_new = engine.generate(fresh, params)
        with pytest.raises(TypeError, match=r"resume\[0\]: expected a SampleGroup"):
            engine.generate(fresh, params, resume=[carried[0].samples[0]])
        with pytest.raises(TypeError, match="resume: expected a list of SampleGroups"):
            engine.generate(fresh, params, resume=carried[0])
    assert [g.prompt_index for g in both.groups] == list(range(len(carried) + len(fresh)))
    assert sorted(seen) == list(range(len(carried) + len(fresh)))
    assert both.metrics["rollout/resumed_samples"] == len(alone.samples)
    want = iter(alone.samples)
    for before, after in zip(carried, both.groups):
        for s0, s1 in zip(before.samples, after.samples):
            if s0.finish_reason != "abort":
                assert s1 is s0
                continue
            w = next(want)
            k = len(s0.response_ids)
            assert s1.response_ids == w.response_ids and s1.response_logprobs == w.response_logprobs
            assert s1.token_versions == [0] * k + [1] * (len(s1.response_ids) - k) and s1.finish_reason == "length"
    for got, plain in zip(both.groups[len(carried):], only_new.groups):
        assert [s.response_ids for s in got.samples] == [s.response_ids for s in plain.samples]
        assert all(s.token_versions == [1] * len(s.response_ids) for s in got.samples)


def test_a_carried_group_with_every_sample_finished_is_judged_without_engine_work():
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3)
    with RolloutEngine(EngineConfig(**CFG)) as engine:
        done = engine.generate(PROMPTS[:2], params)
        batch = engine.generate([], None, resume=done.groups, target_groups=1)
    assert [g.samples for g in batch.groups] == [done.groups[0].samples]
    assert [g.samples for g in batch.aborted] == [done.groups[1].samples]
    assert "rollout/resumed_samples" not in batch.metrics
