"""Checks shared by the nothing-lost tests on one rank and on spawned ranks."""
from __future__ import annotations

from splash_rollout.models.config import PRESETS

EOS = set(PRESETS["glm5-nano"].eos_token_ids)


def assert_every_sample_once(batch, prompts, params, aborted_ok: bool) -> None:
    assert [g.prompt_index for g in batch.groups] == list(range(len(prompts)))
    seeds = []
    for g, prompt, p in zip(batch.groups, prompts, params):
        assert len(g.samples) == p.n
        for s in g.samples:
            seeds.append(s.seed)
            assert s.prompt_ids == prompt
            assert len(s.response_ids) == len(s.response_logprobs) <= p.max_new_tokens
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else EOS)
            assert not stops & set(s.response_ids[:-1]), "generation went on past a stop token"
            if s.finish_reason == "length":
                assert len(s.response_ids) == p.max_new_tokens
            elif s.finish_reason == "stop":
                assert s.response_ids and s.response_ids[-1] in stops
            else:
                assert s.finish_reason == "abort" and aborted_ok, s.finish_reason
                assert len(s.response_ids) < p.max_new_tokens and not stops & set(s.response_ids)
    assert len(set(seeds)) == len(seeds)  # each (prompt, j) is its own request


def assert_only_cache_holds_pages(managers) -> None:
    """No request holds a KV page any more: every allocated page is one the prefix cache alone holds
    (one reference, counted reclaimable), and the rest are free."""
    for rank, m in enumerate(managers):
        state = dict(rank=rank, free=m.num_free, used=m.num_used, refs=m.num_references, held=m.num_held,
                     reclaimable=m.num_reclaimable, pages=m.num_pages)
        assert m.num_used == m.num_held == m.num_reclaimable == m.num_references, state
        assert m.num_free + m.num_held == m.num_pages, state
