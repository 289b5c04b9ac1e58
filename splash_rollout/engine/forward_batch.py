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

from splash_rollout.engine.kv_pool import slots_for


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
    """[seq_len] int64: pool slot of every history position (the new tokens are the last num_new)."""

    @property
    def row_end(self) -> int:
        return self.row_start + self.num_new

    @property
    def start_pos(self) -> int:
        return self.seq_len - self.num_new


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
    scratch: dict[str, Any] = field(default_factory=dict)
    """Per-step state shared between layers (e.g. ``"topk"``: the last DSA selection)."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(cls, items: Sequence[tuple[list[int], int, int, list[int], bool]], page_size: int,
              device: str | torch.device = "cpu") -> "ForwardBatch":
        """items: per request (token_ids, start, num_new, page table, samples_this_step)."""
        ids, pos, seqs, sample_rows = [], [], [], []
        row = 0
        for token_ids, start, num_new, pages, samples in items:
            end = start + num_new
            ids.extend(token_ids[start:end])
            pos.extend(range(start, end))
            seqs.append(SeqInfo(row, num_new, end, slots_for(pages, 0, end, page_size).to(device)))
            if samples:
                sample_rows.append(row + num_new - 1)
            row += num_new
        out_slots = (torch.cat([s.slots[s.start_pos:] for s in seqs]) if seqs
                     else torch.empty(0, dtype=torch.int64, device=device))
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.tensor(pos, dtype=torch.int64, device=device),
            out_slots=out_slots,
            seqs=seqs,
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=device),
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
