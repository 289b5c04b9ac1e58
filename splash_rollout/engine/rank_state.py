"""RankState: what an attention executor reads from its rank; a switch replaces ``view`` and ``shards``."""
from __future__ import annotations

from dataclasses import dataclass

from splash_rollout.distributed.collectives import Comm
from splash_rollout.engine.attention import AttentionBackend
from splash_rollout.engine.kv_pool import KVPool
from splash_rollout.engine.projections import ProjectionShard
from splash_rollout.layout.rank_view import RankView


@dataclass
class RankState:
    view: RankView
    pool: KVPool
    backend: AttentionBackend
    shards: list[ProjectionShard]
    """Per layer: this rank's Q-B / KV-B / O for ``view.head_slice``."""
    comm: Comm
    """Compute-group collectives (counted under ``step/*``)."""
