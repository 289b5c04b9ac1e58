"""AttentionExecutor: how one attention layer runs for one step under one layout.

The model runner hands an executor the normed hidden rows ``x`` and gets back the attention output
rows. Which rows a rank carries between blocks is the executor's too (``local_rows``): every row,
replicated (TP, DOP, CP), or only the rows of the requests it owns (DP-attention, whose feed-forward
block then gathers its input and reduce-scatters its output). Everything a layout changes -- which
heads a rank projects, where a request's KV lives, which collectives run -- lives behind these
methods, so TP / DP / DOP / CP executors swap in without touching the runner.
Executors take their local sizes from what they are constructed with (a rank view of the layout),
never from the world size.
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING

import torch

from splash_rollout.engine.forward_batch import ForwardBatch, device_index
from splash_rollout.engine.parallel_mlp import on_replicated_rows
from splash_rollout.layout import traffic
from splash_rollout.models.config import ModelConfig
from splash_rollout.models.numerics import acc_dtype, partial_dtype

if TYPE_CHECKING:
    from splash_rollout.engine.rank_state import RankState


def element_bytes(dtype: torch.dtype) -> traffic.ElementBytes:
    """The widths of what this process's steps send: ``dtype`` rows, partial sums (and CP's partial
    attention) in the numerics mode's partial dtype, CP's LSE in its accumulation dtype, float32
    indexer scores."""
    act, partial = dtype.itemsize, partial_dtype(dtype).itemsize
    return traffic.ElementBytes(activation=act, partial=partial, attention=act, cp_partial=partial,
                                lse=acc_dtype(dtype).itemsize, score=torch.float32.itemsize)


def step_shape(batch: ForwardBatch, model: ModelConfig, world_size: int, feed_forward: str,
               widths: traffic.ElementBytes) -> traffic.StepShape:
    """What ``layout/traffic.py`` needs of one step's batch on T ranks."""
    owned = [0] * world_size
    for owner, rows in zip(batch.owners, batch.num_new):
        owned[owner] += rows
    page_rounds = -(-batch.max_seq_len // (world_size * batch.page_size))
    return traffic.StepShape(tuple(owned), model.hidden_size, model.num_heads, model.kv_lora_rank,
                             model.qk_rope_head_dim, widths, feed_forward,
                             score_columns=page_rounds * batch.page_size)


class AttentionExecutor(abc.ABC):
    @abc.abstractmethod
    def forward(self, attn: torch.nn.Module, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """attn: the layer's MLAAttention; x: [n, hidden] (after input_layernorm, the rows
        ``local_rows`` names) → [n, hidden]."""

    def local_rows(self, batch: ForwardBatch) -> torch.Tensor | None:
        """The batch rows whose hidden states this rank carries between blocks: None for every row
        (replicated), else [n] int64, ascending."""
        return None

    def local_rows_host(self, batch: ForwardBatch) -> list[int] | None:
        """``local_rows`` on the host."""
        return None

    def feed_forward(self, mlp: torch.nn.Module, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The layer's feed-forward block on the rows this rank carries: x [n, hidden] → [n, hidden]."""
        return mlp(x)

    rank = 0
    """This rank's index in its layout (the single-rank executor: 0)."""

    inputs_stay_local = False
    """Whether a rank's next step reads only the tokens it sampled itself (its rows are its own
    requests'), so the ranks may decode a token window between exchanges (engine/token_window.py)."""

    fixed_shapes = True
    """Whether a decode step padded to a bucket runs the same ops on the same shapes whatever its real
    batch (no collective sized by which rank owns which request): what a CUDA graph of the step needs."""

    def sampling_ranks(self, batch: ForwardBatch) -> list[int]:
        """[R] (host): the rank that computes the logits of each of ``batch.sample_rows`` and samples
        it. One rank here: all of them."""
        return [0] * len(batch.sample_rows_host)

    def sampled_here(self, batch: ForwardBatch) -> list[int]:
        """The places, among the rows this rank carries, of the sampled rows it samples (host), in
        sample order."""
        ranks = self.sampling_ranks(batch)
        mine = [row for row, r in zip(batch.sample_rows_host, ranks) if r == self.rank]  # batch rows, ascending
        carried = self.local_rows_host(batch)
        if carried is not None:  # h holds only this rank's rows: their places among them
            place = {row: i for i, row in enumerate(carried)}
            mine = [place[row] for row in mine]
        return mine

    def sample_logits(self, h: torch.Tensor, batch: ForwardBatch, compute_logits) -> torch.Tensor:
        """Logits [r, vocab] of the sampled rows ``sampling_ranks`` gives this rank, in sample order.
        h: the last layer's output on the rows this rank carries (``local_rows``); ``compute_logits``:
        [k, hidden] -> [k, vocab]."""
        mine = self.sampled_here(batch)
        if mine == list(range(h.shape[0])):
            return compute_logits(h)
        return compute_logits(h.index_select(0, device_index(mine, h.device)))


class RankExecutor(AttentionExecutor):
    """An executor of one rank of a T-rank layout: it reads its rank's state (``RankState``: the
    rank view, pool, backend, projection shards, collectives)."""

    def __init__(self, rank_state: "RankState") -> None:
        self.s = rank_state

    @property
    def rank(self) -> int:
        return self.s.view.rank


class ReplicatedRowsExecutor(RankExecutor):
    """A layout whose ranks all carry every row between blocks (TP, DOP, CP): the sampled rows are
    dealt in T contiguous, nearly equal blocks, so the LM head and the sampler split over the ranks
    like the attention does."""

    def feed_forward(self, mlp: torch.nn.Module, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return on_replicated_rows(mlp, x, self.s.comm)  # [N, hidden] -> [N, hidden], every rank

    def sampling_ranks(self, batch: ForwardBatch) -> list[int]:
        r, t = len(batch.sample_rows_host), self.s.view.world_size
        return [i * t // r for i in range(r)]  # [R]: 0..0, 1..1, ...
