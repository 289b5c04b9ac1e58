"""The FP8 latent-KV token format FlashMLA's V3.2 kernels read, packed and unpacked in torch.

One token is a row of bytes (656 for DeepSeek's 512 + 64 dims):

* ``[0, r)``: the latent ``c_kv`` in float8 e4m3, each tile of 128 values divided by its scale;
* ``[r, r + 4 r / 128)``: one float32 scale per tile (the tile's max |value| / 448, e4m3's largest
  finite value), so dequantising is ``fp8 * scale``;
* then ``rope`` bfloat16 values of ``k_pe``, unquantised (position information is not rounded to fp8).

Quantising rounds each latent value to e4m3 (3 mantissa bits: relative error <= 2^-4 of the value,
plus the tile's subnormal floor); the rope part only rounds to bfloat16. Why it exists: the pool
stores ``[pages, page_size, r + rope]`` in the model dtype; a FlashMLA sparse call reads this format,
and the byte count per token is what a KV transfer in fp8 moves.
"""
from __future__ import annotations

import torch

TILE = 128
"""Latent values sharing one scale."""
FP8_MAX = 448.0
"""Largest finite float8 e4m3fn value."""
FLASHMLA_PAGE = 64
"""The page size FlashMLA's kernels require."""


def fp8_token_bytes(kv_lora_rank: int = 512, rope: int = 64) -> int:
    """Bytes of one packed token: 656 for kv_lora_rank 512 and rope 64."""
    check_dims(kv_lora_rank, rope)
    return kv_lora_rank + 4 * (kv_lora_rank // TILE) + 2 * rope


def check_dims(kv_lora_rank: int, rope: int) -> None:
    if kv_lora_rank <= 0 or kv_lora_rank % TILE:
        raise ValueError(f"kv_lora_rank: the fp8 KV format needs a positive multiple of {TILE}, got {kv_lora_rank}")
    if rope <= 0:
        raise ValueError(f"rope: expected a positive width, got {rope}")


def pack_fp8(c_kv: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """c_kv: [..., r] (r a multiple of 128), k_pe: [..., rope], any float dtype
    → [..., fp8_token_bytes(r, rope)] uint8."""
    r, rope = c_kv.shape[-1], k_pe.shape[-1]
    check_dims(r, rope)
    if c_kv.shape[:-1] != k_pe.shape[:-1]:
        raise ValueError(f"pack_fp8: c_kv {tuple(c_kv.shape)} and k_pe {tuple(k_pe.shape)} disagree on tokens")
    lead = c_kv.shape[:-1]
    tiles = c_kv.float().reshape(*lead, r // TILE, TILE)  # [..., T, 128]
    scale = tiles.abs().amax(-1) / FP8_MAX  # [..., T] float32
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero tile: any scale is exact
    latent = (tiles / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(*lead, r)
    return torch.cat([latent.view(torch.uint8), scale.contiguous().view(torch.uint8),
                      k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)], dim=-1)


def unpack_fp8(packed: torch.Tensor, kv_lora_rank: int = 512, rope: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """packed: [..., fp8_token_bytes(kv_lora_rank, rope)] uint8 → (c_kv [..., r] float32,
    k_pe [..., rope] bfloat16)."""
    width = fp8_token_bytes(kv_lora_rank, rope)
    if packed.dtype != torch.uint8 or packed.shape[-1] != width:
        raise ValueError(f"unpack_fp8: expected uint8 rows of {width} bytes, got {packed.dtype} {tuple(packed.shape)}")
    r, tiles = kv_lora_rank, kv_lora_rank // TILE
    lead = packed.shape[:-1]
    packed = packed.contiguous()
    latent = packed[..., :r].contiguous().view(torch.float8_e4m3fn).float().reshape(*lead, tiles, TILE)
    scale = packed[..., r:r + 4 * tiles].contiguous().view(torch.float32)  # [..., T]
    k_pe = packed[..., r + 4 * tiles:].contiguous().view(torch.bfloat16)
    return (latent * scale[..., None]).reshape(*lead, r), k_pe


def pack_pages(cache: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """One layer's pool pages [pages, page_size, r + rope] → FlashMLA's fp8 k_cache
    [pages, page_size, 1, bytes] uint8 (one KV head)."""
    packed = pack_fp8(cache[..., :kv_lora_rank], cache[..., kv_lora_rank:])
    return packed[:, :, None, :]
