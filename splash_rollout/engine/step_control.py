"""StepControl: the one message the driver (rank 0) sends every rank before each engine step.

Every rank runs the same scheduler replica -- admission, owners, page grants, chunked prefill and
switch re-placement are deterministic functions of the requests and the tokens sampled so far --
so the driver only sends what the other ranks cannot compute themselves: the tokens it sampled in
the previous step, a switch it decided (the policy's choice, ``switch_layout`` or a schedule), and
whether to stop. The message is O(B) bytes and never grows with context length (at B = 256 about
1.3 KB); a switch adds a few bytes, not page tables. Its bytes are counted under ``step/control``
like every other collective. ``rows`` lets each rank check, every step, that its replica made the
same schedule as the driver's; a mismatch is an error naming both counts, never silent drift.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass

import numpy as np
from splash_rollout.distributed.collectives import Comm
from splash_rollout.layout.layouts import Layout


@dataclass(frozen=True)
class StepControl:
    tokens: np.ndarray | None
    """[R] int32: tokens sampled in the previous step, in the order of its sampling requests (None:
    no previous step in this call)."""
    rows: int
    """Query rows of the previous step on the driver (a replica check)."""
    switch: tuple[Layout, bool] | None = None
    """(destination, blocking) to enter at this step's boundary, or None."""
    stop: bool = False
    """The call ends here (after the previous step's tokens are applied)."""
    abort: bool = False
    """With ``stop``: every unfinished request of the call is aborted (``finish_reason`` abort)."""
    failed: str | None = None
    """With ``stop``: the driver failed between steps; every rank raises with this reason."""
    draft_cap: int = 0
    """Most drafted tokens a decoding request verifies this step (0: none; engine/speculation_gate.py)."""


def exchange(comm: Comm, control: StepControl | None) -> tuple[StepControl, int]:
    """Broadcast rank 0's ``control`` over the control group (every rank calls it; only rank 0 passes
    one). Returns (the message, its payload bytes). Counted under ``step/control``."""
    if comm.world_size == 1:
        return control, 0
    payload = pickle.dumps(control, protocol=pickle.HIGHEST_PROTOCOL) if comm.rank == 0 else None
    got = comm.broadcast_bytes(payload, tag="step/control")
    return (control if comm.rank == 0 else pickle.loads(got)), len(got)
