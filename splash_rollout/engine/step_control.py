"""StepControl: the one message the driver (rank 0) sends every rank before each engine step.

Every rank runs the same scheduler replica -- admission, owners, page grants, chunked prefill and
switch re-placement are deterministic functions of the requests and the tokens sampled so far --
so the driver only sends what the other ranks cannot compute themselves: a switch it decided (the
policy's choice, ``switch_layout`` or a schedule), the draft cap (and the MTP module's drafts, which
rank 0 alone computes: a few bytes per drafting request), whether to stop, and how many steps
the message covers (a token window under DP-attention, engine/token_window.py). The sampled
tokens are not in it: every rank samples its share of a step's rows and one all-gather at the end
of the step brings every replica all of them (``Engine._gather_samples``, which also checks that the
replicas scheduled the same). The message is a few hundred bytes whatever the batch or the context
(a switch adds a few bytes, not page tables); its bytes are counted under ``step/control`` like
every other collective.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass

from splash_rollout.distributed.collectives import Comm
from splash_rollout.layout.layouts import Layout


@dataclass(frozen=True)
class StepControl:
    switch: tuple[Layout, bool] | None = None
    """(destination, blocking) to enter at this step's boundary, or None."""
    stop: bool = False
    """The call ends here."""
    abort: bool = False
    """With ``stop``: every unfinished request of the call is aborted (``finish_reason`` abort)."""
    failed: str | None = None
    """With ``stop``: the driver failed between steps; every rank raises with this reason."""
    draft_cap: int = 0
    """Most drafted tokens a decoding request verifies this step (0: none; engine/speculation_gate.py)."""
    drafts: tuple[tuple[int, tuple[int, ...]], ...] = ()
    """Drafting with the MTP module: (request id, drafted tokens) computed on rank 0 for this step
    (engine/mtp_drafter.py); every rank's scheduler verifies exactly these."""
    window: int = 1
    """Steps the ranks run before the next message and the next exchange of sampled tokens (a token
    window, engine/token_window.py; 1: this step only)."""


def exchange(comm: Comm, control: StepControl | None) -> tuple[StepControl, int]:
    """Broadcast rank 0's ``control`` over the control group (every rank calls it; only rank 0 passes
    one). Returns (the message, its payload bytes). Counted under ``step/control``."""
    if comm.world_size == 1:
        return control, 0
    payload = pickle.dumps(control, protocol=pickle.HIGHEST_PROTOCOL) if comm.rank == 0 else None
    got = comm.broadcast_bytes(payload, tag="step/control")
    return (control if comm.rank == 0 else pickle.loads(got)), len(got)
