"""Drafts from the model's MTP module in the engine (engine/mtp_drafter.py).

* What rank 0 drafts is the module of the published equations: after chunked prefill and decode
  steps, the module's state at a request's last verified position and its drafts equal a reference
  that runs the module over the whole sequence at once (teacher-forced rows, then the chain), on a
  prompt long enough that the module's DSA indexer selects.
* Drafts never change a token: with ``speculation="always"`` and MTP drafts the samples equal
  ``"off"``'s -- greedy and sampled, groups that share their prompt, stop tokens, a pool small enough
  to retract -- with a module that drafts well (``mirror_mtp``: it proposes what the model itself
  predicts one position back, which a repetitive model keeps) and with the preset's random one.
* ``draft="mtp"`` on a model without the module is refused naming the field.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams
from splash_rollout.engine.rank_engine import Engine
from splash_rollout.rollout.build import engine_settings
from splash_rollout.engine.request import Request, SamplingSpec
from splash_rollout.models.config import resolve_model
from splash_rollout.models.model import MLAForCausalLM
from splash_rollout.models.mtp import MTP_PREFIX
from tests.unit.test_nothing_lost import assert_nothing_held
from tests.unit.test_speculation import sampling


def mirror_mtp(model: MLAForCausalLM) -> dict[str, torch.Tensor]:
    """MTP tensors under which the module's logits at position i are the model's own at i (its
    attention and feed-forward outputs zero, its projection passing the state through): it drafts
    token i + 1's prediction for token i + 2, which a model that repeats itself keeps."""
    layer = model.model.mtp_layers[0]
    out = {}
    for name, t in layer.state_dict().items():
        value = t.clone()
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            value.zero_()
        elif name == "eh_proj.weight":
            hidden = t.shape[0]
            value.zero_()
            value[:, hidden:] = torch.eye(hidden)
        out[f"{MTP_PREFIX}0.{name}"] = value
    return out


def _reference(model: MLAForCausalLM, tokens: list[int], chain: int) -> tuple[torch.Tensor, list[int]]:
    """(the module's state at the last teacher-forced row [hidden], the argmax chain of ``chain`` drafts),
    from whole-sequence forwards."""
    layer, head = model.model.mtp_layers[0], model.lm_head.weight
    ids = torch.tensor([tokens])
    with torch.no_grad():
        hidden, _ = model._decoder(ids, None)
        state = model.model.norm(hidden)
        rows = [layer.combine(model.model.embed_tokens(ids[:, 1:]), state[:, :-1])[0]]  # row i: (h_i, t_{i+1})
        drafts, first = [], None
        for _ in range(chain):
            x = torch.cat(rows)[None]
            n = x.shape[1]
            out, _ = layer(x, torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril()[None], None)
            first = out[0, len(tokens) - 2] if first is None else first
            drafts.append(int(layer.head_logits(out[0, -1], head).argmax()))
            rows.append(layer.combine(model.model.embed_tokens(torch.tensor([drafts[-1]])), out[0, -1:]))
    return first, drafts


def _settings(config, max_num_batched_tokens: int = 512):
    """Drafting with the module on one rank: 64 pages of 4 tokens."""
    return engine_settings(EngineConfig(model=config, memory=dict(num_pages=64, page_size=4),
                                        batching=dict(max_num_batched_tokens=max_num_batched_tokens),
                                        compute=dict(speculation="always", draft="mtp")))


def test_the_drafts_are_the_modules_of_the_published_equations():
    config = resolve_model("glm5-nano")
    model = MLAForCausalLM.from_config(config, seed=3)
    reference = MLAForCausalLM.from_config(config, seed=3)
    torch.manual_seed(0)
    prompt = torch.randint(3, 500, (90,)).tolist()  # longer than the indexer's top-64: DSA selects
    engine = Engine.single(model, config, _settings(config, max_num_batched_tokens=32))
    req = Request(0, prompt, SamplingSpec(temperature=0.0, max_new_tokens=12, ignore_eos=True), max_len=128)
    engine.serve([req], max_steps=6)  # three prefill chunks, then drafted decode steps
    tokens = req.token_ids
    assert engine.mtp.kv.positions[0] == list(range(len(tokens) - 1))  # every verified position, once
    state, chain = _reference(reference, tokens, 3)
    torch.testing.assert_close(engine.mtp.kv.state[0], state, atol=1e-4, rtol=1e-4)
    engine.mtp._cap.clear()  # its own cap after rejected drafts would cut the chain
    drafts = dict(engine.mtp.draft([req], 3))
    assert list(drafts[0]) == chain
    engine.abort_all()


def test_a_mirrored_module_drafts_tokens_that_are_kept():
    config = resolve_model("glm5-nano")
    model = MLAForCausalLM.from_config(config, seed=0)
    model.load_state_dict(mirror_mtp(model), strict=False)
    engine = Engine.single(model, config, _settings(config))
    reqs = [Request(i, [3, 4, 5, 6, 7, 8, 9, 3, 4], SamplingSpec(temperature=0.0, max_new_tokens=24, ignore_eos=True),
                    max_len=64) for i in range(2)]
    engine.serve(reqs)
    stats = engine.mtp.stats
    assert stats.by_source["mtp"][0] > 0 and stats.accepted > stats.proposed // 3, stats


def test_draft_mtp_without_a_module_is_refused():
    with pytest.raises(ValueError, match="compute.draft='mtp'"):
        EngineConfig(model="kimi-k2", speculation="always", draft="mtp")
    config = resolve_model("glm5-nano").replace(num_mtp_layers=0)  # a model handed in without the module
    with pytest.raises(ValueError, match="draft='mtp'"):
        Engine.single(MLAForCausalLM.from_config(config, seed=0), config,
                      engine_settings(EngineConfig(compute=dict(speculation="always", draft="mtp"),
                                                   memory=dict(num_pages=8)), config))
    with pytest.raises(ValueError, match="draft: expected one of"):
        EngineConfig(model="glm5-nano", draft="eagle")


MAX_LEN = 56


def _engine(speculation: str, draft: str = "auto") -> RolloutEngine:
    # 40 pages of 4 tokens: a few requests at their cap fill it, so optimistic admission retracts
    return RolloutEngine(EngineConfig(model="glm5-nano", speculation=speculation, draft=draft,
                                      numerics="reproducible", num_pages=40, page_size=4, max_model_len=MAX_LEN,
                                      max_num_batched_tokens=64, max_num_seqs=12))


@pytest.fixture(scope="module")
def engines():
    with _engine("off") as off, _engine("always", "mtp") as mirrored, _engine("always", "mtp") as random_init:
        whole = MLAForCausalLM.from_config(resolve_model("glm5-nano"), seed=0)
        mirrored.update_weights(mirror_mtp(whole), version=1)  # a push carries the module to rank 0
        yield off, mirrored, random_init


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(prompts=st.lists(st.lists(st.integers(3, 9), min_size=2, max_size=24), min_size=1, max_size=3),
       n=st.sampled_from([1, 4, 8]), kind=sampling, new=st.integers(1, 48), stop=st.sets(st.integers(3, 9), max_size=1),
       seed=st.integers(0, 2**31))
def test_mtp_drafts_write_what_off_writes(engines, prompts, n, kind, new, stop, seed):
    off, mirrored, random_init = engines
    params = SamplingParams(n=n, max_new_tokens=new, stop_token_ids=tuple(stop), ignore_eos=True, seed=seed, **kind)
    want = off.generate(prompts, params)
    for engine in (mirrored, random_init):
        got = engine.generate(prompts, params)
        assert [s.response_ids for s in got.samples] == [s.response_ids for s in want.samples]
        assert [s.response_logprobs for s in got.samples] == [s.response_logprobs for s in want.samples]
        assert [s.finish_reason for s in got.samples] == [s.finish_reason for s in want.samples]
        assert_nothing_held(engine)


def test_the_mirrored_module_is_kept_and_credited_to_mtp(engines):
    off, mirrored, _ = engines
    params = SamplingParams(n=4, temperature=0.0, max_new_tokens=40, ignore_eos=True)
    batch = mirrored.generate([[5, 6, 7, 8, 9] * 4, [3] * 10], params)
    assert batch.metrics["spec/verified/mtp"] > 0 and batch.metrics["spec/verified/group"] == 0
    assert batch.metrics["spec/acceptance_len/mtp"] > 1.5
    assert batch.metrics["spec/accepted_at/1"] > 0.5
    assert batch.metrics["perf/steps"] < off.generate([[5, 6, 7, 8, 9] * 4, [3] * 10], params).metrics["perf/steps"]


def test_auto_drafts_with_the_module_where_it_is_a_small_share_of_a_step():
    assert EngineConfig(model="glm5-nano", speculation="always").draft_source() == "ngram"  # 1 of 4 layers
    assert EngineConfig(model="glm-5", speculation="always").draft_source() == "mtp"
    assert EngineConfig(model="kimi-k2", speculation="always").draft_source() == "ngram"  # no module
    assert EngineConfig(model="glm-5", speculation="off").draft_source() is None
    assert EngineConfig(model="glm5-nano", speculation="always").served_model().num_mtp_layers == 0
    assert EngineConfig(model="glm5-nano", draft="mtp", speculation="always").served_model().num_mtp_layers == 1


def test_a_requests_cap_never_passes_the_drafters_most():
    from splash_rollout.engine.drafter import next_cap

    assert next_cap(4, 4, 3) == 4 and next_cap(8, 4, 3) == 7 and next_cap(4, 2, 2) == 4 and next_cap(4, 3, 0) == 1
