"""ForwardBatch: everything one model step needs on one rank, as tensors, and the context that makes it current.

The scheduler decides *which* tokens run; a rank turns that into flat row tensors (the new tokens of
every scheduled request, concatenated in schedule order) plus the step's slice of its own block
table (``BlockTable``: the rank's physical page of every logical page, -1 where another rank stores
it). Nothing here is per-position Python: the slots every row writes and every key a request reads
are computed from the block table with a few tensor ops on the batch's device, so building a batch
costs O(B) Python whatever the history lengths.

Nothing here reads the device back either: every size the host needs (rows per request, history
lengths, the sampled rows, the width of the key axis) is known to the scheduler and kept beside the
tensors as Python lists (``seq_lens_host``, ``sample_rows_host``, ``max_seq_len``), and row indices
are made on the host and sent, never found on the device (no ``nonzero`` or boolean masks). A decode
step can also be *padded* to a bucket of requests and a fixed key width (``padded_decode``), so
steps of different batch sizes in one bucket run the same ops on the same shapes -- what a CUDA graph
replays.

Per-step state shared by the layers (the DSA selection that ``shared`` layers reuse, the key slots
of every request) lives in ``scratch``; the batch is made current with ``forward_context`` -- a
context manager that refuses nesting -- rather than in module globals.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import torch


def device_index(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """[n] int64 on ``device`` from host ``values``; ``0, 1, ..., n - 1`` is made there (an arange: no
    host-to-device copy, which a CUDA graph could not capture -- every index of a padded decode step is
    one), anything else copied over."""
    n = len(values)
    if all(v == i for i, v in enumerate(values)):
        return torch.arange(n, dtype=torch.int64, device=device)
    return torch.tensor(list(values), dtype=torch.int64).to(device)


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
    seq_lens_host: list[int]
    """[B] ``seq_lens`` on the host."""
    sample_rows_host: list[int]
    """[R] ``sample_rows`` on the host."""
    sample_seqs_host: list[int]
    """[R] the request (index into B) of each sampled row, on the host."""
    max_seq_len: int
    """Width S of every [.., S] key axis: the longest history of the step, or a padded step's fixed
    width (a multiple of the page size)."""
    whole_here: list[bool] | None = None
    """[B] whether this rank stores every position of the request's history (None: not known)."""
    num_real: int | None = None
    """Requests that are real in a padded decode step; the rest are padding (None: every request)."""
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
    def real_seqs(self) -> int:
        """Requests that are not padding."""
        return self.num_seqs if self.num_real is None else self.num_real

    @property
    def decode_only(self) -> bool:
        """Every request runs one query row (a decode step; row b is request b)."""
        return all(k == 1 for k in self.num_new)

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
        lengths = self.seq_lens_host
        starts = self.query_start
        if self.num_real is not None:  # a padded decode step: one chunk, fixed shapes
            yield PaddedChunk.make(self, list(range(self.num_seqs)), starts[:-1], 1, self.max_seq_len)
            return
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
                out.append(SeqInfo(starts[b], self.num_new[b], self.seq_lens_host[b], slots[b][here], key_pos,
                                   self.owners[b]))
            self.scratch["seqs"] = out
        return self.scratch["seqs"]

    def rows_of(self, seqs: Sequence[int]) -> list[int]:
        """The rows of requests ``seqs`` (host), in the order given."""
        starts = self.query_start
        return [row for b in seqs for row in range(starts[b], starts[b + 1])]

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
            chosen = list(key[1])
            host_rows = self.rows_of(chosen)
            new_seq = [j for j, b in enumerate(chosen) for _ in range(self.num_new[b])]
            index = torch.tensor(chosen, dtype=torch.int64).to(self.device)
            rows = torch.tensor(host_rows, dtype=torch.int64).to(self.device)
            lens = [self.seq_lens_host[b] for b in chosen]
            sub = ForwardBatch(self.input_ids[rows], self.positions[rows], self.out_slots[rows],
                               self.block_table[index], self.seq_lens[index],
                               torch.tensor(new_seq, dtype=torch.int64).to(self.device),
                               torch.empty(0, dtype=torch.int64, device=self.device),
                               [self.num_new[b] for b in chosen], [self.owners[b] for b in chosen], self.page_size,
                               lens, [], [], max(lens, default=0),
                               None if self.whole_here is None else [self.whole_here[b] for b in chosen])
            self.scratch[key] = (sub, rows)
        return self.scratch[key]

    # ---- construction -----------------------------------------------------------------------------
    @classmethod
    def from_rows(cls, input_ids: Sequence[int], starts: Sequence[int], num_new: Sequence[int],
                  samples: Sequence[bool], owners: Sequence[int], block_table: torch.Tensor,
                  page_size: int, whole_here: Sequence[bool] | None = None) -> "ForwardBatch":
        """input_ids: [N] the step's new tokens; starts / num_new / samples / owners: [B] per request
        (first new position, rows, how many of its last rows sample -- 0 or 1, or 1 + k for a
        drafted decode; a bool is 0 / 1 --, owner); block_table: [B, P] int64 on the engine's device,
        this rank's pages. Rows, positions and sampled rows are made on the host and sent in one copy;
        the slots each row writes come from the block table on the device."""
        counts = np.asarray(num_new, dtype=np.int64).reshape(-1)
        first = np.asarray(starts, dtype=np.int64).reshape(-1)
        sampled = np.asarray([int(x) for x in samples], dtype=np.int64).reshape(-1)
        b, n = len(counts), int(counts.sum())
        row_seq = np.repeat(np.arange(b, dtype=np.int64), counts)  # [N]
        first_row = np.cumsum(counts) - counts  # [B]
        positions = first[row_seq] + np.arange(n, dtype=np.int64) - first_row[row_seq]  # [N]
        first_sampled = first_row + counts - sampled  # [B] each request's first sampled row
        sample_rows = (np.repeat(first_sampled, sampled)
                       + np.arange(int(sampled.sum()), dtype=np.int64)
                       - np.repeat(np.cumsum(sampled) - sampled, sampled))  # [R]
        seq_lens = first + counts  # [B]
        return cls._assemble(np.asarray(input_ids, dtype=np.int64).reshape(-1), positions, row_seq, seq_lens,
                             sample_rows, list(num_new), list(owners), block_table, page_size,
                             int(seq_lens.max()) if b else 0, None if whole_here is None else list(whole_here))

    @classmethod
    def padded_decode(cls, input_ids: Sequence[int], starts: Sequence[int], owners: Sequence[int],
                      block_table: torch.Tensor, page_size: int, bucket: int,
                      whole_here: Sequence[bool] | None = None) -> "ForwardBatch":
        """A decode step (one row per request, each sampling) padded to ``bucket`` requests and to the
        key width of ``block_table`` ([bucket, P]: the real requests' rows, then rows of -1): every
        step of a bucket has the same shapes. A padded request is token 0 at position 0 with no
        history here; its KV goes to the pool's scratch slot and its rows' results are never read."""
        real = len(input_ids)
        if real > bucket or block_table.shape[0] != bucket:
            raise ValueError(f"padded_decode: {real} requests, a bucket of {bucket}, a block table of "
                             f"{block_table.shape[0]} rows")
        pad = bucket - real
        positions = np.asarray(list(starts) + [0] * pad, dtype=np.int64)
        seq_lens = np.asarray([s + 1 for s in starts] + [0] * pad, dtype=np.int64)
        rows = np.arange(bucket, dtype=np.int64)
        ids = np.asarray(list(input_ids) + [0] * pad, dtype=np.int64)
        batch = cls._assemble(ids, positions, rows, seq_lens, rows[:real], [1] * bucket, list(owners) + [0] * pad,
                              block_table, page_size, block_table.shape[1] * page_size,
                              None if whole_here is None else list(whole_here) + [True] * pad)
        batch.num_real = real
        return batch

    @classmethod
    def _assemble(cls, input_ids: np.ndarray, positions: np.ndarray, row_seq: np.ndarray, seq_lens: np.ndarray,
                  sample_rows: np.ndarray, num_new: list[int], owners: list[int], block_table: torch.Tensor,
                  page_size: int, width: int, whole_here: list[bool] | None) -> "ForwardBatch":
        """The batch's index tensors in one host-to-device copy (views of one int64 buffer)."""
        device = block_table.device
        n, b, r = len(input_ids), len(seq_lens), len(sample_rows)
        packed = torch.from_numpy(np.concatenate([input_ids, positions, row_seq, seq_lens, sample_rows]))
        packed = packed.to(device, non_blocking=True)
        ids_t, pos_t, row_seq_t, lens_t, sample_t = packed.split([n, n, n, b, r])
        if n:
            page = block_table[row_seq_t, pos_t // page_size]  # [N]
            out_slots = torch.where(page >= 0, page * page_size + pos_t % page_size, torch.full_like(page, -1))
        else:
            out_slots = pos_t
        return cls(ids_t, pos_t, out_slots, block_table, lens_t, row_seq_t, sample_t, num_new, owners, page_size,
                   seq_lens.tolist(), sample_rows.tolist(), row_seq[sample_rows].tolist(), width, whole_here)

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
    rows: torch.Tensor
    """[n] int64: the real rows, in the order ``valid`` picks them out of a [C * Q, ...] result."""
    valid: torch.Tensor
    """[n] int64: the real rows' places in the flattened [C * Q] query axis (made on the host: no
    boolean mask on the device)."""

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

    def real(self, padded: torch.Tensor) -> torch.Tensor:
        """A [C, Q, ...] result's real rows: [n, ...], in ``rows`` order."""
        return padded.flatten(0, 1).index_select(0, self.valid)

    def visible(self, positions: torch.Tensor) -> torch.Tensor:
        """Bool [C, Q, S]: causal and stored keys of real rows (positions: the batch's [N])."""
        s = self.key_stored.shape[1]
        q_pos = positions[self.q_rows]  # [C, Q]
        causal = torch.arange(s, device=q_pos.device)[None, None, :] <= q_pos[..., None]
        return causal & self.key_stored[:, None, :] & self.q_valid[..., None]

    @classmethod
    def make(cls, batch: ForwardBatch, seqs: list[int], first_rows: list[int], q_len: int, keys: int) -> "PaddedChunk":
        device = batch.device
        counts = [batch.num_new[b] for b in seqs]
        rows = [first + j if j < k else 0 for first, k in zip(first_rows, counts) for j in range(q_len)]
        valid = [j < k for k in counts for j in range(q_len)]
        real_rows = [first + j for first, k in zip(first_rows, counts) for j in range(k)]
        places = [c * q_len + j for c, k in enumerate(counts) for j in range(k)]
        idx = device_index(seqs, device)
        stored = batch.key_stored()
        pages = batch.block_table[idx, : -(-keys // batch.page_size)].clamp(min=0)
        q_valid = (torch.ones(len(valid), dtype=torch.bool, device=device) if all(valid)
                   else torch.tensor(valid).to(device))
        return cls(idx, device_index(rows, device).view(len(seqs), q_len), q_valid.view(len(seqs), q_len), pages,
                   stored[idx, :keys], device_index(real_rows, device), device_index(places, device))


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
