"""KVPool: slots address (page, offset); writes land where reads look; NaN fill exposes stray reads."""
import torch

from splash_rollout.engine.kv_pool import KVPool, KVPoolSpec, slots_for
from splash_rollout.models.config import PRESETS


def test_spec_from_glm5_nano():
    cfg = PRESETS["glm5-nano"]
    spec = KVPoolSpec.from_model(cfg)
    assert spec.kv_dim == cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert spec.num_layers == cfg.num_layers
    assert spec.index_head_dims == tuple(cfg.index_head_dim if cfg.layer_has_indexer_cache(i) else 0
                                         for i in range(cfg.num_layers))
    per_token = 4 * (cfg.num_layers * spec.kv_dim + sum(spec.index_head_dims))
    assert spec.bytes_per_token(torch.float32) == per_token
    assert spec.num_pages_for_budget(per_token * 16 * 10 + 5, 16, torch.float32) == 10


def test_slots_for_follows_page_table():
    s = slots_for([5, 2, 9], 0, 10, 4)
    assert s.tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 36, 37]
    assert slots_for([5, 2, 9], 6, 9, 4).tolist() == [10, 11, 36]


def test_write_read_roundtrip_with_nan_fill():
    spec = KVPoolSpec(kv_lora_rank=6, qk_rope_head_dim=2, index_head_dims=(3, 0))
    pool = KVPool(spec, num_pages=6, page_size=4)
    pool.fill_(float("nan"))
    pages = [4, 1]
    slots = slots_for(pages, 0, 7, 4)
    c = torch.randn(7, 6)
    k = torch.randn(7, 2)
    ik = torch.randn(7, 3)
    pool.write_kv(0, slots, c, k)
    pool.write_index_k(0, slots, ik)
    c2, k2 = pool.read_kv(0, slots)
    assert torch.equal(c2, c) and torch.equal(k2, k)
    assert torch.equal(pool.read_index_k(0, slots), ik)
    # the slot after the last written one (same page) is still NaN; other pages untouched
    assert torch.isnan(pool.read_kv(0, slots_for(pages, 7, 8, 4))[0]).all()
    assert torch.isnan(pool.kv[0][[0, 2, 3, 5]]).all()
    assert torch.isnan(pool.kv[1]).all()
    assert pool.index_k[1] is None


def test_torch_ref_backend_over_scattered_nan_pages():
    """The backend reads exactly each request's pages: NaN everywhere else, results equal dense attention."""
    from splash_rollout.engine.attention import causal_allowed, get_backend
    from splash_rollout.engine.forward_batch import ForwardBatch
    from splash_rollout.models.attention_math import absorbed_attention

    g = torch.Generator().manual_seed(0)
    spec = KVPoolSpec(kv_lora_rank=8, qk_rope_head_dim=4, index_head_dims=(0,))
    pool = KVPool(spec, num_pages=12, page_size=4)
    pool.fill_(float("nan"))
    # (total tokens, tokens new this step, page table): a decode row and a prefill chunk mid-prompt
    reqs = [(11, 1, [7, 2, 9]), (9, 5, [0, 11, 4])]
    hist = {}
    for i, (total, _, pages) in enumerate(reqs):
        c, k = torch.randn(total, 8, generator=g), torch.randn(total, 4, generator=g)
        pool.write_kv(0, slots_for(pages, 0, total, 4), c, k)
        hist[i] = (c, k)
    batch = ForwardBatch.build([(list(range(t)), t - n, n, p, True) for t, n, p in reqs], page_size=4)
    q = torch.randn(batch.num_tokens, 3, 8, generator=g)
    qp = torch.randn(batch.num_tokens, 3, 4, generator=g)
    out, lse = get_backend("torch_ref").forward(0, q, qp, pool, batch, None, 0.3)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    for i, seq in enumerate(batch.seqs):
        rows = slice(seq.row_start, seq.row_end)
        ref, ref_lse = absorbed_attention(q[rows], qp[rows], *hist[i],
                                          causal_allowed(seq.start_pos, seq.num_new, seq.seq_len), 0.3)
        assert torch.allclose(out[rows], ref, atol=1e-6) and torch.allclose(lse[rows], ref_lse, atol=1e-6)
