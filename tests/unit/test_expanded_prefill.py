"""Prefill in expanded form equals the absorbed reference, and is chosen only where it is cheaper.

``attend_local`` with the native CPU backend (which takes expanded prefill) is compared with the same
call on the per-request reference backend (always absorbed), over NaN-filled pools, on batches that
mix whole prompts, chunks after earlier positions, decode rows and short chunks, with and without a
DSA selection, for all heads and for a head slice (TP / DOP shards).
"""
from __future__ import annotations

import pytest
import torch

from splash_rollout.engine.attention import get_backend
from splash_rollout.engine.executors.single import attend_local
from splash_rollout.engine.forward_batch import ForwardBatch
from splash_rollout.engine.kv_pool import KVPool, KVPoolSpec
from splash_rollout.engine.projections import slice_projections
from splash_rollout.models.config import PRESETS
from splash_rollout.models.mla import MLAAttention
from splash_rollout.models.numerics import numerics
from splash_rollout.models.rope import RotaryEmbedding
from splash_rollout.native import native_available
from splash_rollout.scheduling.cost_model import expanded_is_cheaper

PAGE = 4
# (history length after the step, rows this step): a whole prompt, a chunk after 4 positions,
# decode rows, a 2-row chunk far into a history (absorbed is cheaper there), another whole prompt
REQUESTS = [(17, 17), (24, 20), (30, 1), (40, 2), (9, 9), (9, 9)]


def layer_and_batch(topk: int | None):
    config = PRESETS["glm5-nano"]  # v (32) narrower than q/k (48): the padded attention path
    config = config.replace(index_n_heads=0) if topk is None else config.replace(index_topk=topk)
    torch.manual_seed(0)
    attn = MLAAttention(config, 0, RotaryEmbedding(config)).eval()
    g = torch.Generator().manual_seed(1)
    num_pages = sum(-(-s // PAGE) for s, _ in REQUESTS) + 3
    pool = KVPool(KVPoolSpec.from_model(config), num_pages=num_pages, page_size=PAGE)
    pool.fill_(float("nan"))
    free = torch.randperm(num_pages, generator=g).tolist()
    items = []
    for s, n in REQUESTS:
        pages = [free.pop() for _ in range(-(-s // PAGE))]
        earlier = torch.tensor([pages[p // PAGE] * PAGE + p % PAGE for p in range(s - n)], dtype=torch.int64)
        pool.write_kv(0, earlier, torch.randn(len(earlier), config.kv_lora_rank, generator=g),
                      torch.randn(len(earlier), config.qk_rope_head_dim, generator=g))
        if pool.index_k[0] is not None:
            pool.write_index_k(0, earlier, torch.randn(len(earlier), config.index_head_dim, generator=g))
        items.append((list(range(n)), s - n, n, pages, True))
    x = torch.randn(sum(n for _, n in REQUESTS), config.hidden_size, generator=g)
    return attn, pool, items, x


@pytest.mark.skipif(not native_available(), reason="no C++ compiler here: the cpu backend falls back to torch")
# with a top-16 selection the 20-row chunk over 24 keys stays absorbed (16 keys a query is cheaper)
@pytest.mark.parametrize("topk,expanded", [(None, [0, 1, 4, 5]), (16, [0, 4, 5])], ids=["causal", "dsa-16"])
@pytest.mark.parametrize("heads", [None, slice(2, 6)], ids=["all-heads", "head-slice"])
def test_expanded_prefill_equals_absorbed(topk, expanded, heads):
    attn, pool, items, x = layer_and_batch(topk)
    shard = slice_projections(attn, heads or slice(0, attn.num_heads))
    outs, plans = [], []
    for backend in ("torch_ref", "cpu"):
        run_pool = KVPool(pool.spec, pool.num_pages, PAGE)
        run_pool.kv = [t.clone() for t in pool.kv]
        run_pool.index_k = [None if t is None else t.clone() for t in pool.index_k]
        batch = ForwardBatch.build(items, page_size=PAGE)
        with numerics("fast"), torch.no_grad():
            outs.append(attend_local(attn, shard, run_pool, get_backend(backend), x, batch))
        plans.append(batch.scratch["prefill_forms"])
    assert plans[0].expanded == []  # the reference backend stays absorbed
    assert plans[1].expanded == expanded and plans[1].absorbed == [b for b in range(len(REQUESTS)) if b not in expanded]
    assert not torch.isnan(outs[1]).any()
    assert torch.allclose(outs[1], outs[0], atol=2e-5, rtol=1e-4), (outs[1] - outs[0]).abs().max()


def test_reproducible_numerics_stay_absorbed():
    attn, pool, items, x = layer_and_batch(None)
    batch = ForwardBatch.build(items, page_size=PAGE)
    with numerics("reproducible"), torch.no_grad():
        attend_local(attn, slice_projections(attn, slice(0, attn.num_heads)), pool, get_backend("cpu"), x, batch)
    assert batch.scratch["prefill_forms"].expanded == []


def test_cost_rule():
    dims = (512, 64, 64, 64)  # kv_lora, nope, rope, v of DeepSeek-V3-shaped checkpoints
    assert expanded_is_cheaper(128, 128, *dims)  # a whole prompt
    assert expanded_is_cheaper(4096, 4096, *dims, 2048)  # 192-wide over every key still beats 1088-wide over 2048
    assert not expanded_is_cheaper(16384, 16384, *dims, 2048)  # a long prompt under a top-2048 DSA selection
    assert expanded_is_cheaper(256, 512, *dims)  # a long chunk after a prefix
    assert not expanded_is_cheaper(1, 500, *dims)  # a decode row
    assert not expanded_is_cheaper(16, 640, *dims)  # a short chunk over a long history
