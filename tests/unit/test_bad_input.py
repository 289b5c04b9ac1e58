"""Bad input to a one-rank RolloutEngine: a clear error naming the field, raised before any
work starts, and nothing already accepted is lost -- the next good call gives exactly the tokens it
would have given had the bad call never been made (seed counters do not move on error).

The multi-rank and torchrun cases are in tests/distributed/test_reliability.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams
from splash_rollout.models.config import PRESETS
from splash_rollout.rollout.validation import agree_across_ranks, check_world_size
from tests.rollout_checks import assert_only_cache_holds_pages

GOOD = [[5, 6, 7, 8], [9, 10]]
# temperature 1 with engine-derived seeds: the tokens depend on the per-call seed counter
SAMPLED = SamplingParams(n=2, max_new_tokens=6, ignore_eos=True)
GREEDY = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
CFG = dict(model="glm5-nano", num_pages=16, page_size=4, max_model_len=32, max_num_batched_tokens=32,
           max_queued_requests=64)


def _tokens(batch):
    return [s.response_ids for s in batch.samples]


def _assert_pages_free(eng):
    assert_only_cache_holds_pages(eng.local_engine.scheduler.placement.managers)


BAD_CALLS = [  # (prompts, sampling, exception, message)
    ([], None, ValueError, r"prompts: expected at least one prompt"),
    ([[]], None, ValueError, r"prompts\[0\]: expected at least one token, got an empty prompt"),
    ([[5], [1, 2, 600]], None, ValueError, r"prompts\[1\]: token ids \[600\] outside the vocabulary \[0, 512\)"),
    ([[-1]], None, ValueError, r"prompts\[0\]: token ids \[-1\] outside the vocabulary"),
    ([[3] * 32], None, ValueError, r"prompts\[0\]: expected fewer than 32 tokens .*max_model_len.*got 32"),
    ([[3, 4.5]], None, TypeError, r"prompts\[0\]\[1\]: expected an integer token id, got float 4.5"),
    ([[3, True]], None, TypeError, r"prompts\[0\]\[1\]: expected an integer token id, got bool"),
    ([5, 6], None, TypeError, r"prompts\[0\]: expected a string or a sequence of token ids, got int"),
    (None, None, TypeError, r"prompts: expected a string or a sequence of prompts, got NoneType"),
    ([[3], [4]], [SamplingParams()], ValueError, r"sampling: expected one SamplingParams or 2, got 1"),
    ([[3]], [{"n": 2}], TypeError, r"sampling\[0\]: expected SamplingParams, got dict"),
    ([[3]], SamplingParams(stop_token_ids=(512,)), ValueError, r"sampling\[0\]\.stop_token_ids: \[512\] outside"),
    ([[3]], 5, TypeError, r"sampling: expected SamplingParams or a list of them, got int"),
    ([b"ab"], None, TypeError, r"prompts\[0\]: expected a string or a sequence of token ids, got bytes"),
    ([[3], [4]], SamplingParams(n=40), ValueError,
     r"sampling: 2 prompts x n ask for 80 samples, more than EngineConfig.batching.max_queued_requests=64"),
]


def test_every_bad_call_is_rejected_before_work_and_loses_nothing():
    with RolloutEngine(EngineConfig(**CFG)) as reference:
        want = [_tokens(reference.generate(GOOD, SAMPLED)) for _ in range(2)]
    with RolloutEngine(EngineConfig(**CFG)) as eng:
        first = _tokens(eng.generate(GOOD, SAMPLED))
        for prompts, sampling, exc, message in BAD_CALLS:
            with pytest.raises(exc, match=message) as info:
                eng.generate(prompts, sampling)
            assert not eng.local_engine.scheduler.has_unfinished, info.value  # nothing was queued
            _assert_pages_free(eng)
        # the good call after the bad ones samples exactly as the second call of a fresh engine
        assert [first, _tokens(eng.generate(GOOD, SAMPLED))] == want


def test_prompt_longer_than_the_pool_names_the_prompt_and_the_remedy():
    with RolloutEngine(EngineConfig(model="glm5-nano", num_pages=4, page_size=4)) as eng:
        with pytest.raises(ValueError, match=r"prompts\[1\]: needs 5 KV pages .* lower max_new_tokens or raise"):
            eng.generate([[3], [3] * 15], SamplingParams(max_new_tokens=4))
        assert _tokens(eng.generate([[3]], GREEDY))


@pytest.mark.parametrize("kw, exc, message", [
    (dict(n=0), ValueError, r"n: expected >= 1, got 0"),
    (dict(n=2.0), TypeError, r"n: expected an integer, got float 2.0"),
    (dict(temperature=-0.5), ValueError, r"temperature: expected >= 0, got -0.5"),
    (dict(temperature=float("nan")), ValueError, r"temperature: expected >= 0, got nan"),
    (dict(temperature="0.7"), TypeError, r"temperature: expected a number, got str"),
    (dict(top_p=0.0), ValueError, r"top_p: expected in \(0, 1\], got 0.0"),
    (dict(top_p=1.01), ValueError, r"top_p: expected in \(0, 1\], got 1.01"),
    (dict(top_k=-2), ValueError, r"top_k: expected -1 \(off\) or >= 0, got -2"),
    (dict(min_p=1.5), ValueError, r"min_p: expected in \[0, 1\], got 1.5"),
    (dict(max_new_tokens=0), ValueError, r"max_new_tokens: expected >= 1, got 0"),
    (dict(max_new_tokens=None), TypeError, r"max_new_tokens: expected an integer, got NoneType"),
    (dict(stop_token_ids=(1, 2.5)), TypeError, r"stop_token_ids: expected integer token ids, got \[2.5\]"),
    (dict(stop_token_ids=5), TypeError, r"stop_token_ids: expected a sequence of integer token ids, got int"),
    (dict(stop_token_ids=None), TypeError, r"stop_token_ids: expected a sequence of integer token ids, got NoneType"),
    (dict(temperature=float("inf")), ValueError, r"temperature: expected 0 \(greedy\) or a finite number >= 0.0001"),
    (dict(temperature=1e-30), ValueError, r"temperature: expected 0 \(greedy\) or a finite number >= 0.0001"),
    (dict(ignore_eos="yes"), TypeError, r"ignore_eos: expected a bool, got str"),
    (dict(seed="7"), TypeError, r"seed: expected an integer, got str"),
])
def test_sampling_params_name_the_field(kw, exc, message):
    with pytest.raises(exc, match=message):
        SamplingParams(**kw)


def test_numpy_and_torch_integers_are_accepted():
    SamplingParams(n=np.int64(2), max_new_tokens=np.int32(3), temperature=np.float32(0.5), stop_token_ids=[np.int64(4)])
    with RolloutEngine(EngineConfig(**CFG)) as eng:
        a = eng.generate([np.array([5, 6, 7, 8]), torch.tensor([9, 10])], GREEDY)
        b = eng.generate(GOOD, GREEDY)
        assert _tokens(a) == _tokens(b)


@pytest.mark.parametrize("kw, message", [
    (dict(layout="zz"), r"layout: unknown layout 'zz'"),
    (dict(world_size=2, switch_schedule={4: "tp", 9: "dpp"}), r"switch_schedule\[9\]: unknown layout 'dpp'"),
    (dict(world_size=2, switch_schedule={-1: "tp"}), r"switch_schedule: steps must be non-negative integers"),
    (dict(world_size=0), r"world_size: expected >= 1, got 0"),
    (dict(dtype="int8"), r"dtype: expected one of"),
    (dict(rank_timeout_s=0), r"rank_timeout_s: expected > 0 seconds, got 0"),
    (dict(max_model_len=1), r"max_model_len: expected >= 2, got 1"),
    (dict(num_pages=0), r"num_pages: expected >= 1, got 0"),
    (dict(max_queued_requests=0), r"max_queued_requests: expected an integer >= 1, got 0"),
])
def test_engine_config_names_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kw)


def test_switch_layout_names_an_unknown_layout():
    with RolloutEngine(EngineConfig(**CFG)) as eng:
        with pytest.raises(ValueError, match=r"dst: unknown layout 'zz'; expected one of tp, cp, dp, dop"):
            eng.switch_layout("zz")


def test_default_rank_timeout_is_at_most_a_minute():
    assert 0 < EngineConfig().parallel.rank_timeout_s <= 60


NANO = PRESETS["glm5-nano"]  # 8 heads, 8 routed experts, dense 384, shared expert 96


@pytest.mark.parametrize("model, world_size, message", [
    (NANO, 3, r"world_size: 3 does not divide num_heads=8 of glm5-nano \(expected a divisor of 8\)"),
    (NANO.replace(n_routed_experts=12), 8, r"world_size: 8 does not divide n_routed_experts=12"),
    (NANO.replace(intermediate_size=100), 8, r"world_size: 8 does not divide intermediate_size=100"),
    (NANO.replace(moe_intermediate_size=36), 8, r"does not divide moe_intermediate_size \* n_shared_experts=36"),
])
def test_world_size_must_divide_every_sharded_dimension(model, world_size, message):
    with pytest.raises(ValueError, match=message):
        check_world_size(model, world_size)
    with pytest.raises(ValueError, match=message):  # raised before any rank is spawned
        RolloutEngine(EngineConfig(model=model, world_size=world_size))
    check_world_size(model, 2)  # every one of them splits over 2 ranks


def test_update_weights_rejects_bad_pushes_whole_and_keeps_the_old_weights():
    new = {n: t + 0.01 * torch.randn_like(t) for n, t in RolloutEngine(EngineConfig(**CFG)).model.state_dict().items()
           if t.is_floating_point()}
    with RolloutEngine(EngineConfig(**CFG)) as eng:
        before = _tokens(eng.generate(GOOD, GREEDY))
        old = {n: t.clone() for n, t in eng.model.state_dict().items()}
        name = "model.layers.0.self_attn.kv_b_proj.weight"
        bad_pushes = [  # each is otherwise the full, good update: a partial write would change the output
            ({**new, "model.no_such.weight": torch.zeros(2)}, ValueError, r"unknown parameter names \['model.no_such"),
            ({**new, name: new[name][:-1]}, ValueError, rf"{name}: expected shape"),
            ({**new, name: new[name].double() + 1e-12}, ValueError,
             rf"{name}: expected dtype torch.float32, got torch.float64, and \d+ of its \d+ values do not cast"),
            ({**new, name: new[name][: new[name].shape[0] // 2]}, ValueError, rf"{name}: has shape .* 1/2 of the full"),
            ({**new, name: torch.full_like(new[name], float("nan"))}, ValueError,
             rf"{name}: {new[name].numel()} of its {new[name].numel()} values are NaN or infinite"),
            ({**new, name: new[name].tolist()}, TypeError, rf"{name}: expected a torch.Tensor, got list"),
            (list(new.items()), TypeError, r"update_weights: expected a dict of name -> tensor, got list"),
        ]
        for push, exc, message in bad_pushes:
            with pytest.raises(exc, match=message):
                eng.update_weights(push, version=9)
            assert all(torch.equal(t, old[n]) for n, t in eng.model.state_dict().items())
            assert eng.weight_version == 0
        assert _tokens(eng.generate(GOOD, GREEDY)) == before
        eng.update_weights(new, version=9)  # the good push does change the output
        after = eng.generate(GOOD, GREEDY)
        assert _tokens(after) != before and after.samples[0].weight_version == 9


def test_every_call_after_shutdown_says_so():
    eng = RolloutEngine(EngineConfig(**CFG))
    eng.shutdown()
    eng.shutdown()  # idempotent
    for call in (lambda: eng.generate(GOOD), lambda: eng.update_weights({}), lambda: eng.switch_layout("dp")):
        with pytest.raises(RuntimeError, match=r"the engine is shut down"):
            call()
    assert eng.abort() == 0


def test_ranks_must_agree_on_their_requests():
    """The torchrun agreement check with a fake gather (the real one runs in test_reliability.py)."""
    def gather_from(others):
        return lambda mine: [mine] + others

    agree_across_ranks(gather_from([("d1", None)]), "d1", None)
    with pytest.raises(ValueError, match=r"prompts: expected the same prompts and sampling on every rank, got 2 "
                                         r"different request sets .*\[\[0, 2\], \[1\]\]"):
        agree_across_ranks(gather_from([("d2", None), ("d1", None)]), "d1", None)
    with pytest.raises(ValueError, match=r"generate: rank 1 rejected its input \(ValueError: prompts\[0\]: boom\)"):
        agree_across_ranks(gather_from([(None, "ValueError: prompts[0]: boom")]), "d1", None)
    own = TypeError("prompts[3][0]: mine")
    with pytest.raises(TypeError, match=r"mine"):
        agree_across_ranks(gather_from([("d1", None)]), None, own)
