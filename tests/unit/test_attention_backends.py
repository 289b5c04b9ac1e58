"""Every attention backend against the per-request reference (``torch_ref``) over NaN-filled pools.

Unused pages hold NaN, so a backend that reads one slot it should not (another request's page, a
position past the history, a padded key, a page another rank stores) returns NaN instead of a
plausibly wrong number. Batches mix decode rows and prefill chunks of different lengths, with and
without a DSA selection, and include pages marked as stored elsewhere (CP / owner layouts).
"""
from __future__ import annotations

import pytest
import torch

from splash_rollout.engine.attention import get_backend
from splash_rollout.engine.attention.cpu_paged import CpuPagedBackend, work_split
from splash_rollout.native import native_available
from splash_rollout.engine.attention.torch_batched import TorchBackend
from splash_rollout.engine.forward_batch import ForwardBatch
from splash_rollout.engine.kv_pool import KVPool, KVPoolSpec
from splash_rollout.models.attention_math import indexer_select
from splash_rollout.models.numerics import numerics

R, ROPE, H, PAGE = 8, 4, 3, 4
# (history length after the step, rows this step): decode rows, prefill chunks, a fresh prompt
REQUESTS = [(11, 1), (9, 5), (1, 1), (23, 1), (17, 17), (6, 2), (40, 1)]


def make_batch(seed: int, stored_elsewhere: bool) -> tuple[KVPool, ForwardBatch]:
    """A NaN-filled pool with every request's history written at scattered pages; with
    ``stored_elsewhere`` every third logical page is -1 (another rank holds it, CP-style)."""
    g = torch.Generator().manual_seed(seed)
    spec = KVPoolSpec(kv_lora_rank=R, qk_rope_head_dim=ROPE, index_head_dims=(0,))
    num_pages = sum(-(-s // PAGE) for s, _ in REQUESTS) + 5
    pool = KVPool(spec, num_pages=num_pages, page_size=PAGE)
    pool.fill_(float("nan"))
    free = torch.randperm(num_pages, generator=g).tolist()
    items = []
    for s, n in REQUESTS:
        pages = [free.pop() for _ in range(-(-s // PAGE))]
        if stored_elsewhere:
            pages = [-1 if i % 3 == 1 else p for i, p in enumerate(pages)]
        for pos in range(s):
            page = pages[pos // PAGE]
            if page >= 0:
                slot = torch.tensor([page * PAGE + pos % PAGE])
                pool.write_kv(0, slot, torch.randn(1, R, generator=g), torch.randn(1, ROPE, generator=g))
        items.append((list(range(n)), s - n, n, pages, True))
    return pool, ForwardBatch.build(items, page_size=PAGE)


def dsa_selection(batch: ForwardBatch, topk: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch.num_tokens, batch.max_seq_len, generator=g)
    return indexer_select(scores, batch.causal(), topk)


@pytest.mark.parametrize("stored_elsewhere", [False, True], ids=["whole", "pages-elsewhere"])
@pytest.mark.parametrize("topk", [None, 4, 64], ids=["causal", "dsa-4", "dsa-64"])
@pytest.mark.parametrize("partial", [False, True])
def test_batched_backend_equals_reference(stored_elsewhere, topk, partial):
    pool, batch = make_batch(0, stored_elsewhere)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(batch.num_tokens, H, R, generator=g)
    q_pe = torch.randn(batch.num_tokens, H, ROPE, generator=g)
    selected = None if topk is None else dsa_selection(batch, topk, 2)
    ref_out, ref_lse = get_backend("torch_ref").forward(0, q, q_pe, pool, batch, selected, 0.3, partial)
    for backend in (TorchBackend(), TorchBackend(chunk_elements=1), CpuPagedBackend()):  # one request per chunk, too
        out, lse = backend.forward(0, q, q_pe, pool, batch, selected, 0.3, partial)
        assert out.dtype == ref_out.dtype and lse.dtype == ref_lse.dtype
        finite = torch.isfinite(ref_lse)  # a row with no key here (pages elsewhere) has lse -inf and out 0
        assert not torch.isnan(out).any() and torch.equal(finite, torch.isfinite(lse))
        assert torch.allclose(out, ref_out, atol=1e-5), (out - ref_out).abs().max()
        assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-5)
        assert torch.equal(out[~finite.all(-1)], torch.zeros_like(out[~finite.all(-1)]))


def test_default_backend_is_batched():
    assert get_backend().name == "torch"


def test_batched_backend_reads_no_other_slot():
    """Poisoning every slot no request may read changes nothing; poisoning one that a row reads does."""
    pool, batch = make_batch(3, stored_elsewhere=False)
    g = torch.Generator().manual_seed(4)
    q, q_pe = torch.randn(batch.num_tokens, H, R, generator=g), torch.randn(batch.num_tokens, H, ROPE, generator=g)
    out, _ = TorchBackend().forward(0, q, q_pe, pool, batch, None, 0.3)
    assert torch.isfinite(out).all()
    slots, stored = batch.key_slots()
    used = slots[stored]
    pool.kv[0].view(-1, R + ROPE)[used[0]] = float("nan")
    poisoned, _ = TorchBackend().forward(0, q, q_pe, pool, batch, None, 0.3)
    assert torch.isnan(poisoned).any()


needs_native = pytest.mark.skipif(not native_available(), reason="no C++ compiler for the native kernel")


@needs_native
@pytest.mark.parametrize("topk", [None, 4], ids=["causal", "dsa-4"])
@pytest.mark.parametrize("partial", [False, True])
def test_native_backend_reproducible_equals_reference_exactly(topk, partial):
    """Under reproducible numerics the native kernel accumulates in float64 like the reference:
    rounded results are bit-identical, partial ones agree to float64 rounding."""
    pool, batch = make_batch(5, stored_elsewhere=True)
    g = torch.Generator().manual_seed(6)
    q, q_pe = torch.randn(batch.num_tokens, H, R, generator=g), torch.randn(batch.num_tokens, H, ROPE, generator=g)
    selected = None if topk is None else dsa_selection(batch, topk, 7)
    with numerics("reproducible"):
        ref_out, ref_lse = get_backend("torch_ref").forward(0, q, q_pe, pool, batch, selected, 0.3, partial)
        out, lse = CpuPagedBackend().forward(0, q, q_pe, pool, batch, selected, 0.3, partial)
    assert out.dtype == ref_out.dtype and lse.dtype == ref_lse.dtype
    if partial:
        assert out.dtype == torch.float64 and torch.allclose(out, ref_out, rtol=0, atol=1e-14)
    else:
        assert torch.equal(out, ref_out)


@needs_native
def test_native_backend_reads_bfloat16_pools():
    pool, batch = make_batch(8, stored_elsewhere=False)
    pool.kv[0] = pool.kv[0].to(torch.bfloat16)
    pool.dtype = torch.bfloat16
    g = torch.Generator().manual_seed(9)
    q, q_pe = torch.randn(batch.num_tokens, H, R, generator=g), torch.randn(batch.num_tokens, H, ROPE, generator=g)
    ref_out, _ = get_backend("torch_ref").forward(0, q, q_pe, pool, batch, None, 0.3)
    out, _ = CpuPagedBackend().forward(0, q, q_pe, pool, batch, None, 0.3)
    assert not torch.isnan(out).any() and torch.allclose(out, ref_out, atol=1e-5)


def test_work_split_keeps_every_thread_busy():
    assert work_split(num_seqs=256, heads=8, threads=2) == (2, 8)  # decode-wide: all heads of a row per item
    rows, group = work_split(num_seqs=1, heads=8, threads=2)  # one request: heads split over the threads
    assert group < 8 and rows * group <= 16
    assert work_split(num_seqs=64, heads=128, threads=2) == (1, 16)
