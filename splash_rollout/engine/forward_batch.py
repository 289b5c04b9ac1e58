"""ForwardBatch: everything one model step needs, and the context that makes it current.

The scheduler decides *which* tokens run; ``ForwardBatch.build`` turns that into flat tensors
(rows of all requests concatenated in schedule order) plus per-request slices and slot tables.
Per-step state (e.g. the DSA top-k selection that ``shared`` layers reuse) lives on the batch, and
the batch is made current with ``forward_context`` -- a context manager that refuses nesting --
rather than in module globals.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch



@dataclass
class SeqInfo:
    """One request's part of the step."""

    row_start: int
    """First row of this request in the flat [N] arrays."""
    num_new: int
    """Query rows of this request this step (prefill chunk length, or 1 for decode)."""
    seq_len: int
    """History length after this step (positions [0, seq_len) are in the pool once KV is written)."""
    slots: torch.Tensor
    """[S_local] int64: pool slot of every history position this rank stores, in position order
    (on a rank that stores the whole history S_local = seq_len and the new tokens are the last num_new)."""
    key_positions: torch.Tensor | None = None
    """[S_local] int64: the positions ``slots`` hold; None means all of [0, seq_len)."""
    owner: int = 0
    """Owner rank of the request (DP-attention / DOP)."""

    @property
    def row_end(self) -> int:
        return self.row_start + self.num_new

    @property
    def start_pos(self) -> int:
        return self.seq_len - self.num_new

    def causal_mask(self, device=None) -> torch.Tensor:
        """Bool [num_new, S_local]: new row i (position start_pos + i) sees stored positions <= its own."""
        q_pos = torch.arange(self.start_pos, self.seq_len, device=device)
        keys = (self.key_positions.to(device) if self.key_positions is not None
                else torch.arange(self.seq_len, device=device))
        return keys[None, :] <= q_pos[:, None]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    """[N] int64: the new tokens of every scheduled request, concatenated."""
    positions: torch.Tensor
    """[N] int64: their positions in their own sequences."""
    out_slots: torch.Tensor
    """[N] int64: pool slot each new token's KV is written to."""
    seqs: list[SeqInfo]
    sample_rows: torch.Tensor
    """[R] int64: rows whose logits are needed (last row of each request that samples this step)."""
    page_size: int = 0
    """Tokens per KV page (CP maps a position to rank (position // page_size) mod T)."""
    scratch: dict[str, Any] = field(default_factory=dict)
    """Per-step state shared between layers (e.g. ``"topk"``: the last DSA selection)."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def owned_by(self, rank: int) -> tuple["ForwardBatch", torch.Tensor]:
        """The sub-batch of the requests ``rank`` owns (rows re-based) and their rows here: [n] int64.

        Cached on the batch, so every layer of a step shares one sub-batch (and its DSA scratch)."""
        key = ("owned_by", rank)
        if key not in self.scratch:
            seqs, rows, start = [], [], 0
            for s in self.seqs:
                if s.owner == rank:
                    rows.append(torch.arange(s.row_start, s.row_end))
                    seqs.append(SeqInfo(start, s.num_new, s.seq_len, s.slots, s.key_positions, s.owner))
                    start += s.num_new
            idx = torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64)
            idx = idx.to(self.input_ids.device)
            sub = ForwardBatch(self.input_ids[idx], self.positions[idx], self.out_slots[idx], seqs,
                               torch.empty(0, dtype=torch.int64, device=idx.device), self.page_size)
            self.scratch[key] = (sub, idx)
        return self.scratch[key]

    @property
    def row_owners(self) -> torch.Tensor:
        """[N] int64: the owner rank of every row."""
        if "row_owners" not in self.scratch:
            owners = [s.owner for s in self.seqs for _ in range(s.num_new)]
            self.scratch["row_owners"] = torch.tensor(owners, dtype=torch.int64, device=self.input_ids.device)
        return self.scratch["row_owners"]

    @classmethod
    def build(cls, items: Sequence[tuple], page_size: int, device: str | torch.device = "cpu") -> "ForwardBatch":
        """items: per request (token_ids, start, num_new, page table, samples_this_step[, owner]).

        ``token_ids`` is the whole sequence, or just the ``num_new`` tokens of this step (what a
        step plan ships to the ranks).

        The page table is this rank's: -1 marks logical pages stored elsewhere (CP, or DP/DOP
        requests owned by another rank); their positions are left out of ``slots`` and their new
        tokens get out slot -1 (not written here)."""
        ids, pos, seqs, sample_rows, out_slots = [], [], [], [], []
        row = 0
        for token_ids, start, num_new, pages, samples, *rest in items:
            end = start + num_new
            ids.extend(token_ids if len(token_ids) == num_new else token_ids[start:end])
            pos.extend(range(start, end))
            table = torch.tensor(pages, dtype=torch.int64)
            all_pos = torch.arange(end, dtype=torch.int64)
            phys = table[all_pos // page_size] if end else table[:0]
            here = phys >= 0
            slot_all = torch.where(here, phys * page_size + all_pos % page_size, torch.full_like(phys, -1))
            whole = bool(here.all())
            seqs.append(SeqInfo(row, num_new, end, slot_all[here].to(device),
                                None if whole else all_pos[here].to(device), rest[0] if rest else 0))
            out_slots.append(slot_all[start:end])
            if samples:
                sample_rows.append(row + num_new - 1)
            row += num_new
        out_slots = (torch.cat(out_slots).to(device) if seqs
                     else torch.empty(0, dtype=torch.int64, device=device))
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.tensor(pos, dtype=torch.int64, device=device),
            out_slots=out_slots,
            seqs=seqs,
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=device),
            page_size=page_size,
        )


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
