"""FlashMLA's side of the engine on the CPU: the 656-byte fp8 KV token format, the paging inputs a
ForwardBatch gives the kernel, and which rows the adapter hands it.

The kernel itself needs CUDA; here a torch emulation of its documented dense-decode contract
(q [b, 1, h, 576], k_cache [blocks, 64, 1, 576], int32 block table and lengths → out [b, 1, h, 512],
lse [b, h, 1]) stands in, so the adapter's metadata and routing are checked against ``torch_ref``
over a NaN-filled pool.
"""
from __future__ import annotations

import pytest
import torch

from splash_rollout.engine.attention import get_backend
from splash_rollout.engine.attention.flashmla_backend import FlashMLABackend, dense_metadata, load_flash_mla
from splash_rollout.engine.attention.kv_format import (FP8_MAX, TILE, fp8_token_bytes, pack_fp8, pack_pages,
                                                       unpack_fp8)
from splash_rollout.engine.attention.torch_batched import TorchBackend
from splash_rollout.engine.forward_batch import ForwardBatch
from splash_rollout.engine.kv_pool import KVPool, KVPoolSpec


def test_token_is_656_bytes_for_deepseek_dims():
    assert fp8_token_bytes(512, 64) == 656
    c, k = torch.randn(5, 512), torch.randn(5, 64)
    packed = pack_fp8(c, k)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 656)


def test_byte_layout_latent_then_scales_then_bf16_rope():
    g = torch.Generator().manual_seed(0)
    c = torch.randn(3, 512, generator=g) * torch.tensor([1.0, 10.0, 0.01, 3.0]).repeat_interleave(TILE)
    k = torch.randn(3, 64, generator=g)
    packed = pack_fp8(c, k)
    scales = packed[:, 512:528].contiguous().view(torch.float32)  # [3, 4]
    assert torch.allclose(scales, c.view(3, 4, TILE).abs().amax(-1) / FP8_MAX)
    assert torch.equal(packed[:, 528:].contiguous().view(torch.bfloat16), k.to(torch.bfloat16))
    latent = packed[:, :512].contiguous().view(torch.float8_e4m3fn).float()
    assert latent.abs().max() <= FP8_MAX and latent.view(3, 4, TILE).abs().amax(-1).eq(FP8_MAX).all()


@pytest.mark.parametrize("spread", [1.0, 1e-3, 1e3])
def test_round_trip_error_bounds(spread):
    """e4m3 keeps 3 mantissa bits: each latent value comes back within 2^-4 of itself (plus the
    tile's subnormal step, scale * 2^-9); the rope part within bfloat16's 2^-8."""
    g = torch.Generator().manual_seed(1)
    c, k = torch.randn(64, 512, generator=g) * spread, torch.randn(64, 64, generator=g) * spread
    c_back, k_back = unpack_fp8(pack_fp8(c, k))
    scale = c.view(64, 4, TILE).abs().amax(-1, keepdim=True) / FP8_MAX
    bound = c.view(64, 4, TILE).abs() * 2 ** -4 + scale * 2 ** -9
    assert ((c_back - c).view(64, 4, TILE).abs() <= bound).all()
    assert ((k_back.float() - k).abs() <= k.abs() * 2 ** -8).all()
    assert c_back.dtype == torch.float32 and k_back.dtype == torch.bfloat16


def test_zero_tokens_round_trip_exactly_and_pages_pack_per_token():
    cache = torch.zeros(2, 64, 576)
    cache[1, 3] = torch.randn(576)
    packed = pack_pages(cache, 512)
    assert packed.shape == (2, 64, 1, 656)
    c, k = unpack_fp8(packed[:, :, 0])
    assert torch.equal(c[0], torch.zeros(64, 512)) and torch.equal(k[0].float(), torch.zeros(64, 64))
    assert torch.allclose(c[1, 3], cache[1, 3, :512], rtol=2 ** -4, atol=1e-2)


def test_bad_format_inputs_are_named():
    with pytest.raises(ValueError, match="kv_lora_rank"):
        pack_fp8(torch.randn(2, 100), torch.randn(2, 64))
    with pytest.raises(ValueError, match="disagree"):
        pack_fp8(torch.randn(2, 512), torch.randn(3, 64))
    with pytest.raises(ValueError, match="656 bytes"):
        unpack_fp8(torch.zeros(2, 600, dtype=torch.uint8))


# ---- the adapter ---------------------------------------------------------------------------------
R, ROPE, H, PAGE = 512, 64, 4, 64


def emulated_dense_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, softmax_scale, causal,
                          use_legacy):
    """flash_mla_with_kvcache's dense bf16 decode as documented, one request at a time in float32."""
    assert q.dtype == k_cache.dtype == torch.bfloat16 and q.shape[1] == 1 and q.shape[-1] == k_cache.shape[-1]
    assert k_cache.shape[1:3] == (64, 1) and block_table.dtype == cache_seqlens.dtype == torch.int32
    assert use_legacy and not causal and (block_table >= 0).all()
    rows = k_cache.reshape(-1, k_cache.shape[-1])
    outs, lses = [], []
    for b in range(q.shape[0]):
        pos = torch.arange(int(cache_seqlens[b]))
        keys = rows[block_table[b, pos // 64].long() * 64 + pos % 64].float()  # [L, 576]
        logits = q[b, 0].float() @ keys.T * softmax_scale  # [H, L]
        lses.append(torch.logsumexp(logits, -1))
        outs.append(torch.softmax(logits, -1) @ keys[:, :head_dim_v])
    return torch.stack(outs)[:, None].to(torch.bfloat16), torch.stack(lses)[:, :, None]


class Recording:
    def __init__(self):
        self.batches = []

    def __call__(self, q, *args, **kwargs):
        self.batches.append(q.shape[0])
        return emulated_dense_decode(q, *args, **kwargs)


def make_batch(stored_elsewhere_seq: int | None = None):
    """bf16 pool, NaN outside written history; requests: decode rows (whole here), a prefill chunk,
    and optionally one decode request whose second page another rank stores."""
    g = torch.Generator().manual_seed(2)
    requests = [(70, 1), (5, 1), (40, 6), (130, 1)]
    num_pages = sum(-(-s // PAGE) for s, _ in requests) + 3
    pool = KVPool(KVPoolSpec(R, ROPE, (0,)), num_pages, PAGE, dtype=torch.bfloat16)
    pool.fill_(float("nan"))
    free = torch.randperm(num_pages, generator=g).tolist()
    items = []
    for i, (s, n) in enumerate(requests):
        pages = [free.pop() for _ in range(-(-s // PAGE))]
        if i == stored_elsewhere_seq:
            pages[1] = -1
        for pos in range(s):
            if pages[pos // PAGE] >= 0:
                pool.write_kv(0, torch.tensor([pages[pos // PAGE] * PAGE + pos % PAGE]),
                              torch.randn(1, R, generator=g), torch.randn(1, ROPE, generator=g))
        items.append((list(range(n)), s - n, n, pages, True))
    return pool, ForwardBatch.build(items, page_size=PAGE)


@pytest.mark.parametrize("elsewhere", [None, 3], ids=["whole", "cp-pages"])
@pytest.mark.parametrize("partial", [False, True])
def test_adapter_serves_whole_decode_rows_and_falls_back_for_the_rest(elsewhere, partial):
    pool, batch = make_batch(elsewhere)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(batch.num_tokens, H, R, generator=g).to(torch.bfloat16)
    q_pe = torch.randn(batch.num_tokens, H, ROPE, generator=g).to(torch.bfloat16)
    kernel = Recording()
    backend = FlashMLABackend(kernel=kernel, fallback=TorchBackend())
    out, lse = backend.forward(0, q, q_pe, pool, batch, None, 0.05, partial)
    ref_out, ref_lse = get_backend("torch_ref").forward(0, q, q_pe, pool, batch, None, 0.05, partial)
    assert kernel.batches == [2 if elsewhere == 3 else 3]  # the prefill chunk (and the CP request) fell back
    assert out.dtype == ref_out.dtype and lse.dtype == ref_lse.dtype and not torch.isnan(out).any()
    assert (out.float() - ref_out.float()).abs().max() <= 1e-2  # both round once to bfloat16
    assert (lse - ref_lse).abs().max() <= 1e-4


def test_adapter_paging_inputs_and_checks():
    pool, batch = make_batch()
    table, seqlens = dense_metadata(batch, torch.tensor([0, 3]))
    assert table.dtype == seqlens.dtype == torch.int32 and seqlens.tolist() == [70, 130]
    assert torch.equal(table[1, :3].long(), batch.block_table[3, :3]) and (table >= 0).all()
    q = torch.zeros(batch.num_tokens, H, R)
    with pytest.raises(ValueError, match="bfloat16"):
        FlashMLABackend(kernel=Recording(), fallback=TorchBackend()).forward(
            0, q, q[..., :ROPE], pool, batch, None, 0.1)
    small = ForwardBatch.build([([1], 0, 1, [0], True)], page_size=16)
    with pytest.raises(ValueError, match="page_size must be 64"):
        FlashMLABackend(kernel=Recording(), fallback=TorchBackend()).forward(
            0, q[:1].bfloat16(), q[:1, :, :ROPE].bfloat16(), pool, small, None, 0.1)


def test_missing_wheel_names_the_install():
    try:
        load_flash_mla()
    except ImportError as exc:
        assert "sgl-flash-mla" in str(exc)
    else:  # only on a CUDA machine with the wheel: the registry then builds the real adapter
        assert get_backend("flashmla").name == "flashmla"


def test_engine_config_refuses_flashmla_without_its_page_size_and_dtype():
    from splash_rollout import EngineConfig

    with pytest.raises(ValueError, match="page_size=16"):
        EngineConfig(attention_backend="flashmla", page_size=16, dtype="bfloat16")
    with pytest.raises(ValueError, match="dtype='float32'"):
        EngineConfig(attention_backend="flashmla", page_size=64)
    EngineConfig(attention_backend="flashmla", page_size=64, dtype="bfloat16")  # valid; built only where it imports


def emulated_sparse_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, softmax_scale,
                           is_fp8_kvcache, indices, use_legacy):
    """flash_mla_with_kvcache's sparse fp8 decode as documented: every index row of -1-padded
    ``page * 64 + offset`` token ids into the 656-byte cache."""
    assert is_fp8_kvcache and use_legacy and block_table is None and cache_seqlens is None
    assert k_cache.dtype == torch.uint8 and k_cache.shape[1:] == (64, 1, 656) and q.shape[2] in (64, 128)
    assert indices.dtype == torch.int32 and indices.shape[1] == q.shape[1] == 1 and indices.shape[-1] % 128 == 0
    c, k_pe = unpack_fp8(k_cache.reshape(-1, 656))
    keys = torch.cat([c, k_pe.float()], -1)  # [T, 576]
    assert int(indices.max()) < keys.shape[0]
    outs, lses = [], []
    for b in range(q.shape[0]):
        idx = indices[b, 0]
        kb = keys[idx[idx >= 0].long()]
        logits = q[b, 0].float() @ kb.T * softmax_scale  # [H, K]
        lses.append(torch.logsumexp(logits, -1))
        outs.append(torch.softmax(logits, -1) @ kb[:, :head_dim_v] if kb.shape[0] else
                    torch.zeros(q.shape[2], head_dim_v))
    return torch.stack(outs)[:, None].to(torch.bfloat16), torch.stack(lses)[:, :, None]


@pytest.mark.parametrize("elsewhere", [None, 3], ids=["whole", "cp-pages"])
def test_sparse_fp8_path_matches_reference_over_the_dequantised_pool(elsewhere):
    """DSA rows through the sparse fp8 call: indices into a compact packing of the step's pages
    give what torch_ref gives over the same keys rounded to fp8 (the format's only loss); pages another
    rank stores are -1 indices."""
    from splash_rollout.models.attention_math import indexer_select

    pool, batch = make_batch(elsewhere)
    heads = 64
    g = torch.Generator().manual_seed(4)
    q = torch.randn(batch.num_tokens, heads, R, generator=g).to(torch.bfloat16)
    q_pe = torch.randn(batch.num_tokens, heads, ROPE, generator=g).to(torch.bfloat16)
    selected = indexer_select(torch.randn(batch.num_tokens, batch.max_seq_len, generator=g), batch.causal(), 20)
    backend = FlashMLABackend(kernel=emulated_sparse_decode, fallback=TorchBackend(), sparse_fp8=True)
    out, lse = backend.forward(0, q, q_pe, pool, batch, selected, 0.05)
    c, k_pe = unpack_fp8(pack_pages(pool.kv[0], R)[:, :, 0])  # the pool as the fp8 format holds it
    pool.kv[0] = torch.cat([c, k_pe.float()], -1).to(torch.bfloat16)
    ref_out, ref_lse = get_backend("torch_ref").forward(0, q, q_pe, pool, batch, selected, 0.05)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and not torch.isnan(out).any()
    assert (out.float() - ref_out.float()).abs().max() <= 2e-2
    finite = torch.isfinite(ref_lse)
    # the reference pool rounds the dequantised keys once more, to bfloat16 (2^-9 of each value)
    assert torch.equal(finite, torch.isfinite(lse)) and (lse[finite] - ref_lse[finite]).abs().max() <= 1e-2
