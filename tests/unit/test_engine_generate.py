"""End-to-end single-rank engine: parity with transformers' generate, logprobs vs the training
forward, seed stability across batch composition, NaN-filled pages, page accounting, validation.

Tiny random HF checkpoints (``tests/hf_tiny.py``, written by transformers' own classes) are loaded
with ``MLAForCausalLM.from_pretrained`` on the engine side; everything runs in float32 on CPU.
"""
from __future__ import annotations

import pytest
import torch

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams
from splash_rollout.models.config import PRESETS
from tests.hf_tiny import save_hf_checkpoint
from tests.rollout_checks import assert_only_cache_holds_pages

# 8 indexer heads: a key scores exactly 0 only when all 8 ReLUs cut it, so the top-k boundary almost
# never falls inside a tie. With ties, transformers' torch.topk choice depends on the row length
# (prompt-length rows in its prefill, cache-length rows in decode) while ours is the row-length-free
# position rule the trainer also uses (attention_math.indexer_select), and greedy parity with
# transformers' generate would be luck; logprob parity with our training forward holds regardless.
TINY_GLM = PRESETS["glm5-nano"].replace(
    name="tiny-glm", hidden_size=64, num_layers=3, num_heads=4, q_lora_rank=32, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128, moe_intermediate_size=32,
    n_routed_experts=4, num_experts_per_tok=2, index_n_heads=8, index_head_dim=16, index_topk=12,
    indexer_types=("full", "shared", "full"), max_position_embeddings=256)
TINY_DSV3 = PRESETS["deepseek-v3"].replace(
    name="tiny-dsv3", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, q_lora_rank=32,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128,
    moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
    topk_group=1, first_k_dense_replace=1, rope_scaling=None, max_position_embeddings=256)

PROMPT_LENS = (5, 17, 33, 46)
NEW_TOKENS = 32


def _prompts(vocab, lens=PROMPT_LENS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module", params=[TINY_GLM, TINY_DSV3], ids=["glm_moe_dsa", "deepseek_v3"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param.name)
    hf = save_hf_checkpoint(request.param, path, seed=3)
    return request.param, str(path), hf


def _engine(path, **kw):
    args = dict(model=path, dtype="float32", page_size=4, max_num_batched_tokens=24, num_pages=128)
    args.update(kw)
    return RolloutEngine(EngineConfig(**args))


def _assert_pages_free(eng):
    assert_only_cache_holds_pages(eng.local_engine.scheduler.placement.managers)


def test_greedy_matches_transformers_generate(checkpoint):
    cfg, path, hf = checkpoint
    prompts = _prompts(cfg.vocab_size)
    with _engine(path) as eng:
        eng.local_engine.state.pool.fill_(float("nan"))  # any read of an unwritten slot would poison the logits
        out = eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True))
        _assert_pages_free(eng)
    assert max(PROMPT_LENS) > 24 and (not cfg.has_indexer or cfg.index_topk < min(PROMPT_LENS[1:]))
    for prompt, group in zip(prompts, out.groups):
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        sample = group.samples[0]
        assert sample.response_ids == ref
        assert sample.finish_reason == "length" and all(map(lambda x: x == x, sample.response_logprobs))


@pytest.mark.parametrize("sampling", [dict(temperature=1.0, top_p=0.9), dict(temperature=0.0)],
                         ids=["sampled", "greedy"])
def test_logprobs_match_training_forward(checkpoint, sampling):
    cfg, path, _ = checkpoint
    prompts = _prompts(cfg.vocab_size, seed=1)
    with _engine(path) as eng:
        out = eng.generate(prompts, SamplingParams(n=2, max_new_tokens=20, ignore_eos=True, seed=11, **sampling))
        worst = 0.0
        for sample in out.samples:
            ids = torch.tensor([sample.prompt_ids + sample.response_ids])
            with torch.no_grad():
                logits = eng.model(ids)[0].float()
            p = len(sample.prompt_ids)
            ref = torch.log_softmax(logits[p - 1:-1], -1).gather(1, torch.tensor(sample.response_ids)[:, None])[:, 0]
            worst = max(worst, (ref - torch.tensor(sample.response_logprobs)).abs().max().item())
        _assert_pages_free(eng)
    assert worst < 1e-5, worst


def test_same_seed_same_tokens_whatever_the_batch(checkpoint):
    cfg, path, _ = checkpoint
    prompts = _prompts(cfg.vocab_size, seed=2)
    sp = SamplingParams(n=2, temperature=1.0, top_k=50, max_new_tokens=16, ignore_eos=True, seed=123)
    with _engine(path) as eng:
        alone = eng.generate([prompts[2]], sp)
        others = SamplingParams(n=3, temperature=0.8, max_new_tokens=24, ignore_eos=True)
        mixed = eng.generate(prompts, [others, others, sp, others])
        _assert_pages_free(eng)
    a = [s.response_ids for s in alone.groups[0].samples]
    b = [s.response_ids for s in mixed.groups[2].samples]
    assert a == b
    assert a[0] != a[1]  # the two samples of a group got different seeds
    assert len({s.seed for g in mixed.groups for s in g.samples}) == 11


def test_validation_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="n:"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="world_size: 3 does not divide"):
        RolloutEngine(EngineConfig(model="glm5-nano", world_size=3))
    with pytest.raises(ValueError, match="layout"):
        EngineConfig(layout="zz")
    with RolloutEngine(EngineConfig(model="glm5-nano", num_pages=8, page_size=4, max_model_len=20)) as eng:
        for bad, field in [([[]], "prompts\\[0\\]"), ([[1, 2, 999]], "vocabulary"), ([[2] * 20], "context")]:
            with pytest.raises(ValueError, match=field):
                eng.generate(bad, SamplingParams(max_new_tokens=2))
        with pytest.raises(ValueError, match="stop_token_ids"):
            eng.generate([[2]], SamplingParams(stop_token_ids=(600,)))
        with pytest.raises(ValueError, match="sampling"):
            eng.generate([[2], [3]], [SamplingParams()])
        assert not eng.local_engine.scheduler.has_unfinished
        out = eng.generate([[2, 3, 4]], SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=0))
        assert len(out.samples[0].response_ids) == 17 and out.samples[0].finish_reason == "length"
        _assert_pages_free(eng)
    with RolloutEngine(EngineConfig(model="glm5-nano", num_pages=2, page_size=4)) as eng:
        with pytest.raises(ValueError, match="num_pages"):
            eng.generate([[2] * 10], SamplingParams(max_new_tokens=5))
        assert not eng.local_engine.scheduler.has_unfinished


def test_preset_seed_fixes_weights():
    a = RolloutEngine(EngineConfig(model="glm5-nano", seed=5, num_pages=4))
    b = RolloutEngine(EngineConfig(model="glm5-nano", seed=5, num_pages=4))
    c = RolloutEngine(EngineConfig(model="glm5-nano", seed=6, num_pages=4))
    sa, sb, sc = (e.model.state_dict() for e in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_string_prompts_and_mixed_sampling_on_preset():
    with RolloutEngine(EngineConfig(model="glm5-nano", num_pages=64, page_size=16)) as eng:
        out = eng.generate(["hello world", [2, 3, 4]],
                           [SamplingParams(n=3, max_new_tokens=5, min_p=0.05, seed=1),
                            SamplingParams(temperature=0.5, top_k=10, max_new_tokens=3, stop_token_ids=(7,))])
        assert out.groups[0].samples[0].prompt_ids == eng.tokenizer.encode("hello world")
        assert [len(g.samples) for g in out.groups] == [3, 1]
        assert all(len(s.response_ids) == len(s.response_logprobs) >= 1 for s in out.samples)
        assert all(s.loss_mask == [1] * len(s.response_ids) for s in out.samples)
        assert out.timeline.to_dict()["phases"][0]["layout"] == "tp" and out.timeline.switches == []
        assert out.metrics["rollout/response_len/max"] <= 5
        _assert_pages_free(eng)
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate([[2]])


def test_failed_step_leaves_no_pages_behind(monkeypatch):
    with RolloutEngine(EngineConfig(model="glm5-nano", num_pages=32, page_size=4)) as eng:
        calls = {"n": 0}
        real = eng.local_engine.runner.hidden

        def flaky(batch, **kwargs):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("boom")
            return real(batch, **kwargs)

        monkeypatch.setattr(eng.local_engine.runner, "hidden", flaky)
        with pytest.raises(RuntimeError, match="boom"):
            eng.generate([[2, 3, 4], [5, 6]], SamplingParams(max_new_tokens=8, ignore_eos=True))
        _assert_pages_free(eng)
        assert not eng.local_engine.scheduler.has_unfinished
        out = eng.generate([[2, 3, 4]], SamplingParams(max_new_tokens=4, ignore_eos=True))
        assert len(out.samples[0].response_ids) == 4


def test_bfloat16_smoke():
    with RolloutEngine(EngineConfig(model="glm5-nano", dtype="bfloat16", num_pages=16, page_size=4,
                                    max_num_batched_tokens=8)) as eng:
        assert eng.local_engine.state.pool.kv[0].dtype == torch.bfloat16
        out = eng.generate([[2, 3, 4, 5, 6, 7, 8, 9, 10, 11]], SamplingParams(n=2, max_new_tokens=6, ignore_eos=True))
        assert all(len(s.response_ids) == 6 for s in out.samples)
        assert all(torch.isfinite(torch.tensor(s.response_logprobs)).all() for s in out.samples)
        _assert_pages_free(eng)
