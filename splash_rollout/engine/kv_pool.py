"""KVPool: the paged latent-KV memory of one rank.

Per layer the pool holds ``kv: (num_pages + 1, page_size, kv_lora_rank + qk_rope_head_dim)`` in the
model dtype -- the MLA cache has no head axis -- and, for DSA layers that run their own indexer,
``index_k: (num_pages + 1, page_size, index_head_dim)``. Tokens are addressed by *slot*
``page * page_size + offset``; page ids come from ``PageManager``. The pool never decides who owns
a page, it only reads and writes slots.

The extra last page is scratch: a row whose KV this rank does not store (slot -1: another rank's
page, or a padded row of a fixed-shape decode step) writes there, so a write never has to find out
on the host which rows to skip (no host sync, fixed shapes). No block table points at it, so it is
never read; it is not counted in ``nbytes`` (``scratch_bytes`` says what it costs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from splash_rollout.models.config import ModelConfig


@dataclass(frozen=True)
class KVPoolSpec:
    """What one rank caches per token, layer by layer (a rank view may hand in local numbers)."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dims: tuple[int, ...]
    """Per layer: indexer-key width cached by that layer, 0 when it caches none."""

    @classmethod
    def from_model(cls, config: ModelConfig) -> "KVPoolSpec":
        dims = tuple(config.index_head_dim if config.layer_has_indexer_cache(i) else 0
                     for i in range(config.num_layers))
        return cls(config.kv_lora_rank, config.qk_rope_head_dim, dims)

    @property
    def num_layers(self) -> int:
        return len(self.index_head_dims)

    @property
    def kv_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Cache bytes per token over all layers."""
        elem = torch.empty((), dtype=dtype).element_size()
        return elem * (self.num_layers * self.kv_dim + sum(self.index_head_dims))

    def num_pages_for_budget(self, budget_bytes: int, page_size: int, dtype: torch.dtype) -> int:
        return int(budget_bytes // (self.bytes_per_token(dtype) * page_size))


class KVPool:
    def __init__(self, spec: KVPoolSpec, num_pages: int, page_size: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        self.spec = spec
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        self.kv: list[torch.Tensor] = [
            torch.zeros(num_pages + 1, page_size, spec.kv_dim, dtype=dtype, device=device)
            for _ in range(spec.num_layers)]
        """Per layer ``(num_pages + 1, page_size, kv_lora_rank + qk_rope_head_dim)``: c_kv | k_pe (the last
        page is scratch)."""
        self.index_k: list[torch.Tensor | None] = [
            torch.zeros(num_pages + 1, page_size, d, dtype=dtype, device=device) if d else None
            for d in spec.index_head_dims]
        """Per layer ``(num_pages + 1, page_size, index_head_dim)`` or None (no indexer cache)."""
        self.generation = 0
        """Bumped whenever a layer's tensors are replaced (resize, release, restore): what a captured
        CUDA graph, which holds their addresses, checks before it replays."""
        self._released_shapes: tuple[list, list] | None = None
        """While released (asleep): the shapes ``restore`` gives back."""

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def nbytes(self) -> int:
        """Bytes of the pages that hold tokens (the scratch page apart)."""
        return self._bytes() - self.scratch_bytes

    @property
    def scratch_bytes(self) -> int:
        """Bytes of the scratch page of every layer."""
        return sum(t.numel() // max(t.shape[0], 1) * t.element_size() for t in self._tensors() if t.shape[0])

    def _tensors(self) -> list[torch.Tensor]:
        return self.kv + [t for t in self.index_k if t is not None]

    def _bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def layer_pages(self, layer: int) -> int:
        """Pages layer ``layer`` holds now (a live switch resizes one layer at a time)."""
        return self.kv[layer].shape[0] - 1

    def scratch_slot(self, layer: int) -> int:
        """The first slot of layer ``layer``'s scratch page."""
        return self.layer_pages(layer) * self.page_size

    def resize_layer(self, layer: int, num_pages: int) -> None:
        """Give layer ``layer`` exactly ``num_pages`` pages, keeping pages [0, min(old, new)).

        A live switch resizes one layer at a time (memory follows the layout: replicated weights take
        KV pages, sharded ones give them back), so the transient is one layer's tensors."""
        def resized(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros((num_pages + 1,) + tuple(t.shape[1:]))
            keep = min(num_pages, t.shape[0] - 1)
            out[:keep] = t[:keep]
            return out

        self.kv[layer] = resized(self.kv[layer])
        if self.index_k[layer] is not None:
            self.index_k[layer] = resized(self.index_k[layer])
        self.generation += 1
        if all(t.shape[0] == num_pages + 1 for t in self.kv):
            self.num_pages = num_pages

    # ---- sleep ---------------------------------------------------------------------------------
    @property
    def released(self) -> bool:
        return self._released_shapes is not None

    def release(self) -> None:
        """Free every tensor of the pool (its contents are dropped: only do this with no request
        holding pages). ``nbytes`` reads 0 until ``restore``."""
        if self.released:
            raise RuntimeError("KVPool.release: already released")
        self._released_shapes = ([tuple(t.shape) for t in self.kv],
                                 [None if t is None else tuple(t.shape) for t in self.index_k])
        self.kv = [t.new_empty((0,) + tuple(t.shape[1:])) for t in self.kv]
        self.index_k = [None if t is None else t.new_empty((0,) + tuple(t.shape[1:])) for t in self.index_k]
        self.generation += 1

    def restore(self) -> None:
        """Allocate the released tensors again (zeroed, the shapes they had)."""
        if not self.released:
            raise RuntimeError("KVPool.restore: nothing released")
        kv_shapes, index_shapes = self._released_shapes
        self.kv = [t.new_zeros(shape) for t, shape in zip(self.kv, kv_shapes)]
        self.index_k = [None if shape is None else t.new_zeros(shape) for t, shape in zip(self.index_k, index_shapes)]
        self._released_shapes = None
        self.generation += 1

    def fill_(self, value: float) -> None:
        """Overwrite every slot (tests fill with NaN so any read of an unwritten slot shows)."""
        for t in self._tensors():
            t.fill_(value)

    # ---- writes ----------------------------------------------------------------------------
    def _here(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """slots with -1 (not stored here) sent to the layer's scratch slot: [N] int64."""
        return torch.where(slots >= 0, slots, torch.full_like(slots, self.scratch_slot(layer)))

    def write_kv(self, layer: int, slots: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        """slots: [N] int64 (-1: stored on another rank: written to scratch); c_kv: [N, kv_lora_rank];
        k_pe: [N, rope]."""
        flat = self.kv[layer].view(-1, self.spec.kv_dim)
        slots = self._here(layer, slots)
        r = self.spec.kv_lora_rank
        flat[slots, :r] = c_kv.to(self.dtype)
        flat[slots, r:] = k_pe.to(self.dtype)

    def write_index_k(self, layer: int, slots: torch.Tensor, index_k: torch.Tensor) -> None:
        """slots: [N] int64 (-1: stored on another rank: written to scratch); index_k: [N, index_head_dim]."""
        cache = self.index_k[layer]
        if cache is None:
            raise RuntimeError(f"layer {layer} caches no indexer keys")
        cache.view(-1, cache.shape[-1])[self._here(layer, slots)] = index_k.to(self.dtype)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy whole pages ``src[i]`` -> ``dst[i]`` in every layer (copy-on-write of a shared page)."""
        if not src:
            return
        device = self.kv[0].device
        s = torch.tensor(src, dtype=torch.int64, device=device)
        d = torch.tensor(dst, dtype=torch.int64, device=device)
        for t in self.kv + [t for t in self.index_k if t is not None]:
            t[d] = t[s]

    # ---- reads -------------------------------------------------------------------------------
    def read_kv(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots: [S] int64 → (c_kv [S, kv_lora_rank], k_pe [S, qk_rope_head_dim])."""
        rows = self.kv[layer].view(-1, self.spec.kv_dim).index_select(0, slots)
        r = self.spec.kv_lora_rank
        return rows[:, :r], rows[:, r:]

    def read_index_k(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """slots: [S] int64 → index_k [S, index_head_dim]."""
        cache = self.index_k[layer]
        if cache is None:
            raise RuntimeError(f"layer {layer} caches no indexer keys")
        return cache.view(-1, cache.shape[-1]).index_select(0, slots)


def slots_for(pages: list[int], start: int, end: int, page_size: int) -> torch.Tensor:
    """Slots of token positions [start, end) of a request whose page table is ``pages``: [end-start] int64."""
    pos = torch.arange(start, end, dtype=torch.int64)
    table = torch.tensor(pages, dtype=torch.int64)
    return table[pos // page_size] * page_size + pos % page_size
