"""The prefix cache: a finished request's full pages serve a later request that starts with the same
tokens (only the new tokens are prefilled, the samples unchanged), cached pages give way before
anything is retracted, and new weights empty the cache."""
from __future__ import annotations

import pytest
import torch

from splash_rollout.engine.rank_engine import Engine
from splash_rollout.rollout.build import engine_settings
from splash_rollout.rollout.config import EngineConfig
from splash_rollout.engine.page_manager import PageManager
from splash_rollout.engine.prefix_cache import PrefixCache
from splash_rollout.engine.request import Request, SamplingSpec
from splash_rollout.layout.layouts import Ownership
from splash_rollout.models.config import PRESETS
from splash_rollout.models.model import MLAForCausalLM
from splash_rollout.models.numerics import numerics

CFG = PRESETS["glm5-nano"]
PAGE = 8


def _engine(cache: bool, pages: int = 64) -> Engine:
    return Engine.single(MLAForCausalLM.from_config(CFG, seed=5), CFG,
                         engine_settings(EngineConfig(model=CFG, memory=dict(num_pages=pages, page_size=PAGE,
                                                                          prefix_cache=cache),
                                                      compute=dict(attention_backend="torch", speculation="off",
                                                                   cpu_share=False))))


def _request(rid: int, prompt: list[int], new: int = 6, seed: int = 0) -> Request:
    return Request(rid, list(prompt), SamplingSpec(temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=seed),
                   4096)


def _turns(engine: Engine) -> tuple[list[Request], list[dict]]:
    """An agent's two turns: the second's prompt is the first's whole context plus a reply."""
    first = engine.serve([_request(0, list(range(3, 40)), seed=1)])[0]
    reply = [7, 8, 9, 10, 11]
    second = engine.serve([_request(1, first.prompt_ids + first.output_ids + reply, seed=2)])[0]
    return [first, second], engine.step_log


def test_the_next_turn_prefills_only_what_is_new_and_samples_the_same():
    with numerics("reproducible"):
        (first, second), log = _turns(_engine(cache=True))
        (plain_first, plain_second), plain_log = _turns(_engine(cache=False))
    assert (second.output_ids, second.output_logprobs) == (plain_second.output_ids, plain_second.output_logprobs)
    context = first.num_tokens - 1  # the computed part of the first turn (its last token has no KV yet)
    cached = sum(s.cached_tokens for s in log)
    assert cached == context // PAGE * PAGE  # every full computed page of the first turn
    assert sum(s.prefill_rows for s in log) == sum(s.prefill_rows for s in plain_log) - cached
    assert all(s.cached_tokens == 0 for s in plain_log)


def test_cached_pages_count_as_free_and_give_way_before_any_retraction():
    engine = _engine(cache=True, pages=12)
    for i in range(3):  # each leaves 2-3 full pages cached
        engine.serve([_request(i, [50 + i] * 20, new=4, seed=i)])
    placement = engine.scheduler.placement
    assert placement.pages_cached[0] > 0 and placement.pages_in_use == [0]
    assert placement.pages_free == [12]  # cached-only pages are available
    finished = engine.serve([_request(9, list(range(3, 60)), new=30, seed=9)])  # needs 11 pages: evicts
    assert finished[0].num_output_tokens == 30 and finished[0].num_retractions == 0
    assert engine.scheduler.cache.evicted_pages > 0


def test_new_weights_and_sleep_empty_the_cache():
    engine = _engine(cache=True)
    _turns(engine)
    assert engine.scheduler.placement.pages_cached[0] > 0
    engine.update_weights({"model.norm.weight": torch.ones(CFG.hidden_size)})
    assert engine.scheduler.placement.pages_cached == [0] and engine.scheduler.cache.num_pages == 0
    engine.serve([_request(5, list(range(3, 30)))])
    engine.sleep()
    assert engine.scheduler.cache.num_pages == 0
    engine.wake_up()


def test_matching_compares_tokens_and_owners():
    managers = [PageManager(16, 4), PageManager(16, 4)]
    cache = PrefixCache(managers, 4, Ownership.OWNER)
    req = _request(0, list(range(10)))
    req.owner, req.num_computed_tokens = 1, 9
    req.rank_pages = [[-1, -1, -1], managers[1].allocate(3)]
    cache.insert(req)  # pages 0-1 full and computed (positions 0-7)
    assert cache.num_pages == 2 and managers[1].num_held == 2
    owner, chain = cache.match(list(range(12)), 5, [0, 1])
    assert owner == 1 and [n.depth for n in chain] == [0, 1]
    assert [n.depth for n in cache.match([0, 1, 2, 3, 4, 99] + list(range(6, 12)), 5, [0, 1])[1]] == [0]  # page 1 differs
    assert cache.match([0, 1, 2, 99] + list(range(4, 12)), 5, [0, 1])[1] == []  # page 0 differs
    assert cache.match(list(range(12)), 1, [0, 1])[1][-1].depth == 0  # capped
    managers[1].free(req.rank_pages[1])
    assert managers[1].num_reclaimable == 2 and managers[1].num_available == 16
    with pytest.raises(RuntimeError, match="already cached"):
        managers[1].hold(chain[0].pages[1])


@pytest.mark.parametrize("seed", [0, 1])
def test_tight_pools_with_shared_groups_sample_what_an_uncached_engine_samples(seed):
    """Rounds of groups that repeat earlier prompts, grow past them and share pages among their
    samples, in a pool far too small for all of it: the cache hands pages back on demand (no allocation
    ever fails), the samples equal a cache-off engine's, and once the cache is emptied every page is free."""
    import random

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(9, 38))] for _ in range(4)]
    rounds = []
    for r in range(6):
        groups = []
        for _ in range(rng.randint(1, 3)):
            base = rng.choice(prompts)
            prompt = base + [rng.randrange(3, 500) for _ in range(rng.choice([0, 0, 5, 12]))]
            groups.append((prompt, rng.choice([1, 2, 4]), rng.randint(2, 12)))
        rounds.append(groups)

    def run(cache: bool):
        engine = _engine(cache, pages=14)
        out, rid = [], 0
        for groups in rounds:
            reqs = []
            for gi, (prompt, n, new) in enumerate(groups):
                for j in range(n):
                    reqs.append(_request(rid, prompt, new=new + j, seed=100 * gi + j))
                    rid += 1
            with numerics("reproducible"):
                done = engine.serve(reqs)
            out.append(sorted((r.request_id, r.output_ids, r.output_logprobs) for r in done))
        return out, engine

    cached, engine = run(True)
    plain, _ = run(False)
    assert cached == plain
    assert sum(s.cached_tokens for s in engine.step_log) > 0  # the cache served some prompts
    engine.scheduler.clear_cache()
    m = engine.scheduler.placement.managers[0]
    assert m.num_free == m.num_pages and m.num_reclaimable == 0 and m.num_held == 0


def test_a_page_only_the_cache_holds_can_always_be_evicted():
    """Two prompts share their first page, each computed on its own: the shorter request's copy is
    cached first; when the longer one's first sample ends, its later pages must not hang below that
    copy (its sibling still holds them), or the copy could never be evicted -- and a pool that counts
    it free would fail to allocate while the sibling grows."""
    first = list(range(3, 11))  # one full page (PAGE = 8)
    reqs = lambda: [_request(0, first + [40, 41, 42], new=1, seed=1),  # noqa: E731
                    _request(1, first + list(range(50, 62)), new=5, seed=2),
                    _request(2, first + list(range(50, 62)), new=40, seed=3)]
    with numerics("reproducible"):
        cached = _engine(True, pages=8).serve(reqs())
        plain = _engine(False, pages=8).serve(reqs())
    key = lambda done: sorted((r.request_id, r.output_ids, r.output_logprobs) for r in done)  # noqa: E731
    assert key(cached) == key(plain)
