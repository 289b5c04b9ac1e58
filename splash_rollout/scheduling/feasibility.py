"""What fits where, as the policy plans it: one owner for every "does the batch fit" question.

The policy asks it four ways, and each is this class's answer over the deployment's per-rank KV
pools (in tokens; ``Deployment.pools``):

* can a layout hold these requests (their expected totals when entering it, their live context
  when staying in it): ``holds``;
* can it also take one layer's incoming switch buffers beyond that (paper Eq. 5): ``holds_switch``;
* how much of the queue's admission plan its pool admits: ``admits``;
* which layouts a pressure-relief switch may go to: ``holds`` again, on the batch's expected totals.

The engine answers the same questions in pages for the requests it really holds (a request that no
layout's empty pool could ever hold is refused at submission; a switch whose pages are not free is
deferred): ``engine/placement.py`` ``KVPlacement.can_ever_admit`` owns that rule, over page managers.
"""
from __future__ import annotations

import numpy as np

from splash_rollout.layout import Layout, fits
from splash_rollout.scheduling.admission_plan import AdmissionPlan
from splash_rollout.scheduling.deployment import Deployment


class KVFit:
    """The deployment's pools, asked whether a batch fits."""

    def __init__(self, deployment: Deployment) -> None:
        self.dep = deployment

    def pool(self, layout: Layout) -> int:
        """KV tokens one rank's pool holds in ``layout`` (0: the layout has no pool here)."""
        return self.dep.pools.get(layout, 0)

    def holds(self, layout: Layout, tokens: np.ndarray, owners: np.ndarray, less_tokens: int = 0) -> bool:
        """Whether ``layout``'s pool, less ``less_tokens`` per rank, holds requests of ``tokens`` ([B]
        int64) owned by ``owners`` ([B] int64), on every rank."""
        return fits(layout, tokens, self.pool(layout) - less_tokens, self.dep.world_size, owners)

    def holds_switch(self, dst: Layout, tokens: np.ndarray, owners: np.ndarray, layer_buffer_bytes: int) -> bool:
        """Eq. 5: whether ``dst`` holds the requests plus one layer's incoming switch buffers
        (``layer_buffer_bytes`` per rank) beyond them."""
        if layer_buffer_bytes == 0:
            return True
        extra = -(-layer_buffer_bytes // self.dep.sizes.kv_bytes_per_token_total)  # in pool tokens
        return self.holds(dst, tokens, owners, less_tokens=extra)

    def admits(self, layout: Layout, plan: AdmissionPlan, hold: np.ndarray, owners: np.ndarray) -> int:
        """How many of ``plan``'s requests ``layout``'s pool admits next to the running ``hold``."""
        return plan.admits(layout, hold, owners, self.pool(layout), self.dep.world_size)
