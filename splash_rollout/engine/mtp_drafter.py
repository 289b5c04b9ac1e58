"""Drafts from the model's own MTP module (models/mtp.py), computed on rank 0 and verified like any draft.

A draft never changes a token -- verification is seed-exact, so samples equal ``speculation="off"``'s
whatever is proposed -- so where a draft is computed is a question of cost, not of correctness. Here
rank 0 computes them all and the step's control message carries them to every rank
(``StepControl.drafts``): every scheduler replica then verifies the same drafts, whatever the layout
and across live switches, with no collective of its own. Rank 0 holds the whole module (one decoder
layer, its norms and projection; the embedding, final norm and LM head are the served model's),
the other ranks none of it.

What the module needs, per request and position i: the decoder's final-normed state h_i and the
token i + 1. Both are known once a step has sampled, so after every step rank 0 runs the module over
the step's verified rows -- prefill chunks, decode rows, the kept part of a verification -- and keeps
its latent KV (and, on a DSA model, its indexer keys) per request, by position (``shadow``): the
module attends the whole history as the model defines it, whether the step drafted or not. That pass
is the module's standing cost, one decoder layer over the step's rows: 1.6 % of a DeepSeek-V3 step,
a quarter of a glm5-nano one (``compute.draft="auto"`` drafts with the module only where it is small). Before the next step it drafts: the module's row at the last
verified position gives draft 1 and its state; draft j > 1 comes from the module's row at the next
position, fed its own state and draft j - 1 (``draft``). Those chained rows are provisional: the next
``shadow`` of the request drops every entry at or past the first position it writes.

Positions the module never saw -- a prefix served from the cache, the steps of a token window
(their tokens are provisional), rows another rank carries under DP-attention -- are left out of its
attention: that costs acceptance, never a token. (Running it only on the steps that draft was tried:
its first drafts after a plain stretch were kept 0.24 of the time at the first position instead of
0.75.)

The module runs under fast numerics whatever the engine's: a draft need not be reproducible
across batch shapes (it is computed once, on one rank), and float64 accumulation would cost most of
a pass.

``coupled`` drafts: each drafted token is the engine sampler's draw from the module's distribution
with the uniform the verifier will use for that token (the sample's seed, the token's response
index), so a module whose distribution matches the policy's proposes the token the policy will
sample, not only its argmax; greedy samples get the argmax either way.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from splash_rollout.engine.drafter import DraftStats, next_cap
from splash_rollout.engine.mtp_kv import MTPKV
from splash_rollout.engine.request import Request
from splash_rollout.models.attention_math import indexer_scores, indexer_select, softmax_attention
from splash_rollout.models.config import ModelConfig
from splash_rollout.models.moe import routing_apart
from splash_rollout.models.mtp import MTP_PREFIX, MTPLayer
from splash_rollout.models.numerics import numerics
from splash_rollout.models.weights import Target, full_shapes_of

SOURCE = "mtp"


def coupled_drafts(logits: torch.Tensor, specs: list, draw_index: list[int]) -> torch.Tensor:
    """logits [R, V] (a draft model's), each row's sample settings and response index -> [R] int64: the
    token the engine's sampler draws from them with that sample's uniform for that token."""
    from splash_rollout.engine.sampler import SamplingBatch, sample_torch

    tokens, _ = sample_torch(logits.float(), SamplingBatch.make(specs, draw_index, device=logits.device))
    return tokens


def mtp_shapes(config: ModelConfig, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Full name -> (shape, dtype) of the first MTP module's tensors (what a weight push may carry)."""
    return {f"{MTP_PREFIX}0.{n}": s for n, s in full_shapes_of(_skeleton(config, dtype)).items()}


def _skeleton(config: ModelConfig, dtype: torch.dtype) -> MTPLayer:
    from splash_rollout.models.model import MLAForCausalLM

    whole = MLAForCausalLM.skeleton(config.replace(num_mtp_layers=1), dtype)
    return whole.model.mtp_layers[0]


def take_mtp_module(model: nn.Module, device: torch.device) -> MTPLayer:
    """An in-memory model's first MTP module, moved to ``device`` (before the rank places the model,
    which drops it)."""
    layers = getattr(getattr(model, "model", None), "mtp_layers", ())
    if not len(layers):
        raise ValueError("draft='mtp': the model handed in has no MTP module (model.mtp_layers is empty)")
    return layers[0].to(device).eval()


def empty_mtp_module(source, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> MTPLayer:
    """Storage on ``device`` for the first MTP module, for a loader to fill from ``source`` (its
    ``mtp_targets``, read in the same pass as the rank's own tensors). Raises when the source holds none."""
    from splash_rollout.models.model import materialize

    prefix = f"{MTP_PREFIX}0."
    if not any(n.startswith(prefix) for n in source.shapes()):
        raise ValueError(f"draft='mtp': the weight source holds no MTP module (no tensor named {prefix}*, in a "
                         f"checkpoint model.layers.{config.num_layers}.*)")
    module = _skeleton(config, dtype)
    materialize(module, device)
    return module.eval()


def mtp_targets(module: MTPLayer) -> dict[str, list[Target]]:
    """Full name -> the module's tensor (whole): what a loader fills and a weight push writes."""
    return {f"{MTP_PREFIX}0.{n}": [Target(t)] for n, t in module.state_dict(keep_vars=True).items()}


@dataclass
class ShadowRows:
    """A request's rows the module runs over after a step: positions ``start .. start + n - 1``."""

    request_id: int
    start: int
    next_tokens: list[int]
    """[n] token i + 1 of each row's position i."""
    hidden: torch.Tensor
    """[n, hidden] the decoder's last-layer output at those positions (the module reads it final-normed)."""
    copy_from: int | None = None
    """A follower forked off its leader's last prompt row: the leader's entries before ``start``
    become its own first."""


class MTPDrafter:
    """The ``Drafter`` of an engine that drafts with the MTP module. Every rank has one (they propose
    what the control message carried); rank 0's holds the module and computes the drafts."""

    def __init__(self, module: MTPLayer | None, embed: nn.Module | None = None, final_norm: nn.Module | None = None,
                 head: torch.Tensor | None = None, max_draft: int = 4, coupled: bool = True) -> None:
        if max_draft < 1:
            raise ValueError(f"MTPDrafter: max_draft must be >= 1, got {max_draft}")
        self.module, self.embed, self.final_norm, self.head = module, embed, final_norm, head
        """Rank 0: the module, the served model's embedding, final norm and LM head weight [V, hidden]."""
        self.max_draft, self.coupled = max_draft, coupled
        self.stats = DraftStats()
        self._drafts: dict[int, tuple[int, ...]] = {}
        """This step's drafts by request id (from the control message)."""
        self._cap: dict[int, int] = {}
        """request id -> its draft cap after its last verification (the same rule as every drafter's)."""
        self.kv = MTPKV()
        """Rank 0: the module's entries per request."""
        self.pass_seconds: dict[int, float] = {}
        """Rank 0: rows-bucket (bit length of the rows) -> measured seconds of one pass (exponential
        average): what ``cost`` prices a step's drafting with."""
        self.spent = 0.0
        """Rank 0: seconds spent in passes since ``take_spent`` last read it."""

    # ---- the Drafter calls (every rank, same order, same arguments) -------------------------------
    def new_call(self) -> None:
        pass

    def propose(self, request: Request, max_tokens: int) -> tuple[int, ...]:
        limit = min(max_tokens, self.cap(request))
        if limit <= 0:
            return ()
        self.stats.asked += 1
        draft = self._drafts.get(request.request_id, ())[:limit]
        if draft:
            self.stats.drafted_requests += 1
        return draft

    def observe(self, request: Request, drafted: int, accepted: int) -> None:
        if drafted:
            self.stats.verified(SOURCE, drafted, accepted)
            self._cap[request.request_id] = next_cap(self.max_draft, drafted, accepted)

    def finished(self, request: Request) -> None:
        self._cap.pop(request.request_id, None)
        self.kv.drop(request.request_id)

    def source(self, request: Request) -> str:
        return SOURCE

    def cap(self, request: Request) -> int:
        return self._cap.get(request.request_id, self.max_draft)

    def receive(self, drafts: tuple[tuple[int, tuple[int, ...]], ...]) -> None:
        """Every rank, after the control message: the drafts of the step about to run."""
        self._drafts = dict(drafts)

    # ---- rank 0: the module ------------------------------------------------------------------------
    @torch.inference_mode()
    def shadow(self, rows: list[ShadowRows]) -> None:
        """Run the module over a step's verified rows (teacher-forced), replacing each request's entries
        from its first row's position on."""
        own = [r for r in rows if r.next_tokens and r.copy_from is None]
        forks = [r for r in rows if r.next_tokens and r.copy_from is not None]
        with numerics("fast"):
            self._run(own)
            for r in forks:  # after their leaders' rows: they start from the leader's entries
                self.kv.copy(r.copy_from, r.request_id, r.start)
            self._run(forks)

    def _run(self, rows: list[ShadowRows]) -> None:
        if not rows:
            return
        device = rows[0].hidden.device
        tokens = torch.tensor([t for r in rows for t in r.next_tokens], dtype=torch.int64, device=device)
        states = self.final_norm(torch.cat([r.hidden for r in rows]))  # [R, hidden]: h_i, final-normed
        x = self.module.combine(self.embed(tokens), states)  # [R, hidden]
        positions = [list(range(r.start, r.start + len(r.next_tokens))) for r in rows]
        self._layer(x, [r.request_id for r in rows], positions)

    @torch.inference_mode()
    def draft(self, requests: list[Request], cap: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """Drafts of up to ``cap`` tokens (each request's own cap too) for the decoding requests whose
        last verified position the module has seen: ((request id, tokens), ...) for the control message."""
        with numerics("fast"):
            return self._draft(requests, cap)

    def _draft(self, requests: list[Request], cap: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
        chains = []
        for req in requests:
            k = min(cap, self.cap(req), req.max_total_tokens - req.num_tokens - 1)
            state = self.kv.state.get(req.request_id)
            if k > 0 and state is not None and self.kv.last_position(req.request_id) == req.num_tokens - 2:
                chains.append((req, k, state))
        if not chains:
            return ()
        drafts: dict[int, list[int]] = {req.request_id: [] for req, _, _ in chains}
        states = torch.stack([state for _, _, state in chains])  # [B, hidden]
        live = list(range(len(chains)))
        for j in range(max(k for _, k, _ in chains)):
            logits = self.module.head_logits(states, self.head)  # [b, V]
            picked = self._pick(logits, [chains[i][0] for i in live], j)
            for i, token in zip(live, picked):
                drafts[chains[i][0].request_id].append(token)
            keep = [n for n, i in enumerate(live) if chains[i][1] > j + 1]
            if not keep:
                break
            live = [live[n] for n in keep]
            ids = torch.tensor([picked[n] for n in keep], dtype=torch.int64, device=states.device)
            x = self.module.combine(self.embed(ids), states[keep])  # the module's own state stands in for h
            states = self._layer(x, [chains[i][0].request_id for i in live],
                                 [[chains[i][0].num_tokens - 1 + j] for i in live])
        return tuple((rid, tuple(tokens)) for rid, tokens in drafts.items())

    def _pick(self, logits: torch.Tensor, requests: list[Request], j: int) -> list[int]:
        """Draft j (0-based) of each request from the module's logits [b, V]."""
        if not self.coupled:
            return logits.argmax(dim=-1).tolist()
        return coupled_drafts(logits, [r.spec for r in requests], [r.num_output_tokens + j for r in requests]).tolist()

    def cost(self, cap: int, requests: int) -> float | None:
        """Seconds drafting adds to a step where ``requests`` requests draft up to ``cap`` tokens: the
        ``cap - 1`` chained passes (draft 1 is read off the pass every step runs), at the measured
        seconds of a pass of about that many rows (the nearest width measured; None before any)."""
        if cap <= 1 or requests <= 0:
            return 0.0
        if not self.pass_seconds:
            return None
        width = requests.bit_length()
        nearest = min(self.pass_seconds, key=lambda w: (abs(w - width), -w))
        return (cap - 1) * self.pass_seconds[nearest]

    def take_spent(self) -> float:
        """Seconds spent in the module's passes since the last call (rank 0: a step's share)."""
        spent, self.spent = self.spent, 0.0
        return spent

    def _layer(self, x: torch.Tensor, request_ids: list[int], positions: list[list[int]]) -> torch.Tensor:
        """The module's decoder layer over rows x [R, hidden] (each request's rows contiguous, in order, at
        ``positions``), entering their entries first; returns its output at each request's last row
        [B, hidden], and times the pass."""
        start = time.perf_counter()
        out = self._pass(x, request_ids, positions)
        seconds = time.perf_counter() - start
        self.spent += seconds
        width = len(request_ids).bit_length()
        old = self.pass_seconds.get(width, seconds)
        self.pass_seconds[width] = old + 0.3 * (seconds - old)
        return out

    def _pass(self, x: torch.Tensor, request_ids: list[int], positions: list[list[int]]) -> torch.Tensor:
        """``_layer``'s work. The requests are padded to a common query and key length and attended at once."""
        layer, attn = self.module, self.module.self_attn
        device = x.device
        flat = torch.tensor([p for ps in positions for p in ps], dtype=torch.int64, device=device)  # [R]
        normed = layer.input_layernorm(x)
        q_nope, q_pe, q_a = attn.project_q(normed, flat)  # [R, H, nope], [R, H, rope]
        c_kv, k_pe = attn.project_kv(normed, flat)  # [R, r], [R, rope]
        parts = [c_kv, k_pe, flat[:, None]]  # the position kept exactly (int64)
        indexer = attn.indexer
        if indexer is not None:
            parts.append(indexer.index_k(normed, flat))  # [R, D]
        for rid, ps in zip(request_ids, positions):
            self.kv.keep_before(rid, ps[0])
        self.kv.append(request_ids, positions, parts)
        padded, key_counts = self.kv.gather(request_ids)  # [B, S, ...] each, [B]
        b, q, keys = len(request_ids), max(map(len, positions)), padded[0].shape[1]
        starts = torch.tensor([0] + [len(ps) for ps in positions], device=device).cumsum(0)[:-1]  # [B]
        lengths = torch.tensor([len(ps) for ps in positions], device=device)  # [B]
        slot = torch.arange(q, device=device)  # [Q]
        real_q = slot[None, :] < lengths[:, None]  # [B, Q]
        row = torch.where(real_q, starts[:, None] + slot[None, :], starts[:, None])  # [B, Q] padded rows repeat
        real_k = torch.arange(keys, device=device)[None, :] < key_counts[:, None]  # [B, S]
        key_pos = padded[2][..., 0]  # [B, S]
        allowed = real_k[:, None, :] & (key_pos[:, None, :] <= flat[row][..., None])  # [B, Q, S]
        if indexer is not None and keys > indexer.topk:  # (fewer keys: every one is selected)
            index_q, index_w = indexer.index_q(normed, q_a, flat)  # [R, Hi, D], [R, Hi]
            scores = indexer_scores(index_q[row], index_w[row], padded[3])  # [B, Q, S]
            allowed = indexer_select(scores.reshape(b * q, keys), allowed.reshape(b * q, keys), indexer.topk,
                                     indexer.tie_break).reshape(b, q, keys)
        out, _ = softmax_attention(attn.absorb_q(q_nope)[row], q_pe[row], padded[0], padded[1], allowed[:, :, None, :],
                                   attn.softmax_scale, "bqhr,bsr->bqhs")  # [B, Q, H, r]
        h = x + attn.output(out[real_q].to(x.dtype))  # [R, hidden]
        with routing_apart():
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        last = (starts + lengths - 1).tolist()
        for rid, i in zip(request_ids, last):
            self.kv.state[rid] = h[i]
        return h[last]
