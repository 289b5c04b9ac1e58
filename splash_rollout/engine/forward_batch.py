"""ForwardBatch: everything one model step needs on one rank, as tensors, and the context that makes it current.

The scheduler decides *which* tokens run; a rank turns that into flat row tensors (the new tokens of
every scheduled request, concatenated in schedule order) plus the step's slice of its own block
table (``BlockTable``: the rank's physical page of every logical page, -1 where another rank stores
it). Nothing here is per-position Python: the slots every row writes and every key a request reads
are computed from the block table with a few tensor ops on the batch's device, so building a batch
costs O(B) Python whatever the history lengths.

Per-step state shared by the layers (the DSA selection that ``shared`` layers reuse, the key slots
of every request) lives in ``scratch``; the batch is made current with ``forward_context`` -- a
context manager that refuses nesting -- rather than in module globals.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch


@dataclass
class SeqInfo:
    """One request's part of the step, as the per-request reference backend reads it."""

    row_start: int
    """First row of this request in the flat [N] arrays."""
    num_new: int
    """Query rows of this request this step (prefill chunk length, or 1 for decode)."""
    seq_len: int
    """History length after this step (positions [0, seq_len) are in the pool once KV is written)."""
    slots: torch.Tensor
    """[S_local] int64: pool slot of every history position this rank stores, in position order."""
    key_positions: torch.Tensor
    """[S_local] int64: the positions ``slots`` hold."""
    owner: int = 0

    @property
    def row_end(self) -> int:
        return self.row_start + self.num_new

    @property
    def start_pos(self) -> int:
        return self.seq_len - self.num_new

    def causal_mask(self, device=None) -> torch.Tensor:
        """Bool [num_new, S_local]: new row i (position start_pos + i) sees stored positions <= its own."""
        q_pos = torch.arange(self.start_pos, self.seq_len, device=device)
        return self.key_positions.to(device)[None, :] <= q_pos[:, None]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    """[N] int64: the new tokens of every scheduled request, concatenated."""
    positions: torch.Tensor
    """[N] int64: their positions in their own sequences."""
    out_slots: torch.Tensor
    """[N] int64: pool slot each new token's KV is written to on this rank (-1: stored elsewhere)."""
    block_table: torch.Tensor
    """[B, P] int64: this rank's physical page of each request's logical pages (-1: not here);
    P covers the longest history of the step."""
    seq_lens: torch.Tensor
    """[B] int64: history length of each request after this step."""
    row_seq: torch.Tensor
    """[N] int64: the request (index into B) of every row."""
    sample_rows: torch.Tensor
    """[R] int64: rows whose logits are needed (last row of each request that samples this step)."""
    num_new: list[int]
    """[B] query rows per request (host copy)."""
    owners: list[int]
    """[B] owner rank per request (DP-attention / DOP), host copy."""
    page_size: int
    scratch: dict[str, Any] = field(default_factory=dict)
    """Per-step state shared between layers (e.g. the last DSA selection)."""

    # ---- sizes ----------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.num_new)

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def query_start(self) -> list[int]:
        """[B + 1] first row of each request, and N at the end (host)."""
        if "query_start" not in self.scratch:
            starts = [0]
            for n in self.num_new:
                starts.append(starts[-1] + n)
            self.scratch["query_start"] = starts
        return self.scratch["query_start"]

    @property
    def max_seq_len(self) -> int:
        """Longest history of the step: the width of every [.., S] key axis (host)."""
        if "max_seq_len" not in self.scratch:
            self.scratch["max_seq_len"] = int(self.seq_lens.max()) if self.num_seqs else 0
        return self.scratch["max_seq_len"]

    # ---- derived tensors (cached per step: every layer reads the same) ---------------------------
    def key_stored(self) -> torch.Tensor:
        """Bool [B, S] (S = ``max_seq_len``): whether this rank stores each history position of each
        request (False past a request's length and where another rank holds the page)."""
        if "key_stored" not in self.scratch:
            pos = torch.arange(self.max_seq_len, device=self.device)
            pages = self.block_table.index_select(1, pos // self.page_size)
            self.scratch["key_stored"] = (pages >= 0) & (pos[None, :] < self.seq_lens[:, None])
        return self.scratch["key_stored"]

    def key_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots [B, S] int64, stored [B, S] bool): the pool slot of every history position of
        every request (0 where not stored here; those must be masked) and ``key_stored``."""
        if "key_slots" not in self.scratch:
            pos = torch.arange(self.max_seq_len, device=self.device)
            pages = self.block_table.index_select(1, pos // self.page_size)
            stored = self.key_stored()
            self.scratch["key_slots"] = torch.where(stored, pages * self.page_size + pos % self.page_size,
                                                    torch.zeros_like(pages))
        return self.scratch["key_slots"], self.key_stored()

    def causal(self) -> torch.Tensor:
        """Bool [N, S]: row n may see position s (s <= its own position, s inside its request)."""
        if "causal" not in self.scratch:
            pos = torch.arange(self.max_seq_len, device=self.device)
            self.scratch["causal"] = pos[None, :] <= self.positions[:, None]
        return self.scratch["causal"]

    def padded_chunks(self, per_key: int, budget: int) -> Iterator["PaddedChunk"]:
        """The step's requests padded to a common query and key length, in chunks: decode requests
        (one row) and prefill chunks form separate groups, each sorted by history length and cut so
        that keys x ``per_key`` elements (per query row and key) stay within ``budget``."""
        lengths = self.seq_lens.tolist()
        starts = self.query_start
        decode = [b for b, k in enumerate(self.num_new) if k == 1]
        prefill = [b for b, k in enumerate(self.num_new) if k > 1]
        for group in (decode, prefill):
            if not group:
                continue
            group.sort(key=lambda b: lengths[b])
            q_len = max(self.num_new[b] for b in group)
            chunk: list[int] = []
            for b in group + [None]:
                if chunk and (b is None or (len(chunk) + 1) * lengths[b] * q_len * per_key > budget):
                    yield PaddedChunk.make(self, chunk, [starts[c] for c in chunk], q_len, lengths[chunk[-1]])
                    chunk = []
                if b is not None:
                    chunk.append(b)

    @property
    def seqs(self) -> list[SeqInfo]:
        """Per request: the slots and positions this rank stores (for the per-request reference backend)."""
        if "seqs" not in self.scratch:
            slots, stored = self.key_slots()
            starts, out = self.query_start, []
            for b in range(self.num_seqs):
                here = stored[b]
                key_pos = torch.nonzero(here).flatten()
                out.append(SeqInfo(starts[b], self.num_new[b], int(self.seq_lens[b]), slots[b][here], key_pos,
                                   self.owners[b]))
            self.scratch["seqs"] = out
        return self.scratch["seqs"]

    @property
    def row_owners(self) -> torch.Tensor:
        """[N] int64: the owner rank of every row."""
        if "row_owners" not in self.scratch:
            owners = torch.tensor(self.owners, dtype=torch.int64, device=self.device)
            self.scratch["row_owners"] = owners.index_select(0, self.row_seq) if self.num_seqs else owners
        return self.scratch["row_owners"]

    def owned_by(self, rank: int) -> tuple["ForwardBatch", torch.Tensor]:
        """The sub-batch of the requests ``rank`` owns (rows re-based) and their rows here: [n] int64.

        Cached on the batch, so every layer of a step shares one sub-batch (and its DSA scratch)."""
        return self.subset([b for b, o in enumerate(self.owners) if o == rank])

    def subset(self, seqs: Sequence[int]) -> tuple["ForwardBatch", torch.Tensor]:
        """The sub-batch of requests ``seqs`` (ascending indices into B; rows re-based, no sampled rows)
        and their rows in this batch: [n] int64. Cached on the batch, so every layer of a step shares
        one sub-batch."""
        key = ("subset", tuple(seqs))
        if key not in self.scratch:
            seq_idx = torch.tensor(key[1], dtype=torch.int64, device=self.device)
            chosen = torch.zeros(self.num_seqs, dtype=torch.bool, device=self.device)
            chosen[seq_idx] = True
            rows = torch.nonzero(chosen.index_select(0, self.row_seq)).flatten()
            new_seq = torch.full((self.num_seqs,), -1, dtype=torch.int64, device=self.device)
            new_seq[seq_idx] = torch.arange(len(key[1]), device=self.device)
            sub = ForwardBatch(self.input_ids[rows], self.positions[rows], self.out_slots[rows],
                               self.block_table[seq_idx], self.seq_lens[seq_idx], new_seq[self.row_seq[rows]],
                               torch.empty(0, dtype=torch.int64, device=self.device),
                               [self.num_new[b] for b in key[1]], [self.owners[b] for b in key[1]], self.page_size)
            self.scratch[key] = (sub, rows)
        return self.scratch[key]

    # ---- construction -----------------------------------------------------------------------------
    @classmethod
    def from_rows(cls, input_ids: Sequence[int], starts: Sequence[int], num_new: Sequence[int],
                  samples: Sequence[bool], owners: Sequence[int], block_table: torch.Tensor,
                  page_size: int) -> "ForwardBatch":
        """input_ids: [N] the step's new tokens; starts / num_new / samples / owners: [B] per request
        (first new position, rows, how many of its last rows sample -- 0 or 1, or 1 + k for a
        drafted decode; a bool is 0 / 1 --, owner); block_table: [B, P] int64 on the engine's device,
        this rank's pages. Rows and slots are made with tensor ops."""
        device = block_table.device
        b = len(num_new)
        counts = torch.tensor(num_new, dtype=torch.int64, device=device)
        start_t = torch.tensor(starts, dtype=torch.int64, device=device)
        row_seq = torch.repeat_interleave(torch.arange(b, device=device), counts)
        first_row = torch.cumsum(counts, 0) - counts  # [B]
        n = int(counts.sum()) if b else 0
        positions = start_t.index_select(0, row_seq) + torch.arange(n, device=device) - first_row.index_select(0, row_seq)
        if n:
            page = block_table[row_seq, positions // page_size]
            out_slots = torch.where(page >= 0, page * page_size + positions % page_size, torch.full_like(page, -1))
        else:
            out_slots = positions
        sampled = torch.tensor([int(s) for s in samples], dtype=torch.int64, device=device)  # [B]
        first_sampled = first_row + counts - sampled  # [B] each request's first sampled row
        rank_in_request = torch.arange(int(sampled.sum()), device=device) - torch.repeat_interleave(
            torch.cumsum(sampled, 0) - sampled, sampled)  # [R] 0, 1, ... within each request
        sample_rows = torch.repeat_interleave(first_sampled, sampled) + rank_in_request  # [R]
        return cls(torch.tensor(list(input_ids), dtype=torch.int64, device=device), positions, out_slots,
                   block_table, start_t + counts, row_seq, sample_rows, list(num_new), list(owners), page_size)

    @classmethod
    def build(cls, items: Sequence[tuple], page_size: int, device: str | torch.device = "cpu") -> "ForwardBatch":
        """From explicit page tables (tests, one-off callers). items: per request
        (token_ids, start, num_new, page table, samples_this_step[, owner]); ``token_ids`` is the whole
        sequence or just the ``num_new`` new tokens; -1 in a page table marks a page stored elsewhere."""
        ids, starts, news, samples, owners, tables = [], [], [], [], [], []
        for token_ids, start, num_new, pages, sample, *rest in items:
            ids.extend(token_ids if len(token_ids) == num_new else token_ids[start:start + num_new])
            starts.append(start)
            news.append(num_new)
            samples.append(sample)
            owners.append(rest[0] if rest else 0)
            tables.append(list(pages))
        width = max((len(t) for t in tables), default=0)
        table = torch.full((len(tables), max(width, 1)), -1, dtype=torch.int64)
        for i, t in enumerate(tables):
            table[i, :len(t)] = torch.tensor(t, dtype=torch.int64)
        return cls.from_rows(ids, starts, news, samples, owners, table.to(device), page_size)


@dataclass
class PaddedChunk:
    """Some requests of a step padded to ``[C, Q]`` query rows and ``S`` keys (see ``padded_chunks``)."""

    seq_index: torch.Tensor
    """[C] int64: the requests (indices into the batch's B)."""
    q_rows: torch.Tensor
    """[C, Q] int64: each padded query's row in the flat [N] arrays (0 where padding)."""
    q_valid: torch.Tensor
    """[C, Q] bool: real rows."""
    key_pages: torch.Tensor
    """[C, P] int64: the physical page of every logical page (0 where not stored here), P*page >= S."""
    key_stored: torch.Tensor
    """[C, S] bool: position stored on this rank and inside the request."""

    def gather(self, cache: torch.Tensor, zero_hidden: bool = True) -> torch.Tensor:
        """Every history position's row of one layer's paged cache ``(num_pages, page_size, W)``,
        gathered a page at a time: [C, S, W]. With ``zero_hidden`` the rows of positions not stored
        here (other ranks' pages, past the request, padding) are exact zeros; without, they hold
        whatever the page they point at holds and the caller must mask what it computes from them."""
        c, s = self.key_stored.shape
        rows = cache[self.key_pages].view(c, -1, cache.shape[-1])[:, :s]  # [C, S, W]
        if zero_hidden:
            rows = rows.masked_fill(~self.key_stored[..., None], 0)
        return rows

    @property
    def rows(self) -> torch.Tensor:
        """[n] int64: the real rows, in the order ``tensor[q_valid]`` flattens them."""
        return self.q_rows[self.q_valid]

    def visible(self, positions: torch.Tensor) -> torch.Tensor:
        """Bool [C, Q, S]: causal and stored keys of real rows (positions: the batch's [N])."""
        s = self.key_stored.shape[1]
        q_pos = positions[self.q_rows]  # [C, Q]
        causal = torch.arange(s, device=q_pos.device)[None, None, :] <= q_pos[..., None]
        return causal & self.key_stored[:, None, :] & self.q_valid[..., None]

    @classmethod
    def make(cls, batch: ForwardBatch, seqs: list[int], first_rows: list[int], q_len: int, keys: int) -> "PaddedChunk":
        device = batch.device
        idx = torch.tensor(seqs, dtype=torch.int64, device=device)
        first = torch.tensor(first_rows, dtype=torch.int64, device=device)
        counts = torch.tensor([batch.num_new[b] for b in seqs], dtype=torch.int64, device=device)
        j = torch.arange(q_len, device=device)
        valid = j[None, :] < counts[:, None]
        rows = torch.where(valid, first[:, None] + j[None, :], torch.zeros_like(first)[:, None])
        stored = batch.key_stored()
        pages = batch.block_table[idx, : -(-keys // batch.page_size)].clamp(min=0)
        return cls(idx, rows, valid, pages, stored[idx, :keys])


_current: list[ForwardBatch] = []


@contextlib.contextmanager
def forward_context(batch: ForwardBatch) -> Iterator[ForwardBatch]:
    """Make ``batch`` the current step's batch; nesting is a bug and raises."""
    if _current:
        raise RuntimeError("forward_context: a forward batch is already active (nested steps)")
    _current.append(batch)
    try:
        yield batch
    finally:
        _current.pop()


def current_batch() -> ForwardBatch:
    if not _current:
        raise RuntimeError("current_batch: no forward batch is active")
    return _current[0]
