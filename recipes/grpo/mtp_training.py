"""The model's MTP module trained alongside the policy, so its drafts follow the policy they draft for.

Why: drafts from the MTP module (models/mtp.py) are only worth what it predicts of the *current*
policy's text; one left at its post-SFT weights drafts what an older policy would have written while
GRPO moves on (the GLM team's slime keeps it training during RL for this reason). Here:

* its loss is a term of the policy's own forward and backward (``Trainer.optimizer_step(...,
  mtp=)``; the model's ``forward(..., mtp="detached")``): the module reads the decoder's
  final-normed states, the shared embedding and the shared LM head without gradient, so the term
  trains the module alone -- it learns to predict the policy, never the policy to suit it -- and the
  decoder's forward is not run twice;
* its own AdamW steps after the policy's (``step``): the policy's optimizer, gradient clipping and
  ZeRO master copy leave the MTP parameters out, so the policy trains token for token as it would
  without the module;
* the loss is the cross entropy of the token two ahead over the trained tokens that have a draft
  (SFT: the reference solutions; GRPO: the rollout's responses), averaged over them; the module's
  gradients are averaged over the ranks, so its replicas stay equal.

Measured (``measure``, on a step's first ``measure_samples`` samples, before the module trains on
them): ``mtp/accept_top1``, the share of response tokens (from the second on: the first has no
draft) equal to the module's argmax -- an argmax draft kept; with the samples' sampling settings
(GRPO), ``mtp/accept_coupled``, the share equal to the token the engine's sampler draws from the
module's distribution with the sample's own uniform for that token (engine/sampler.py,
engine/random_draws.py) -- a draft that shares the sample's randomness, kept whenever the two
distributions put that uniform on the same token. ``mtp_frozen/*``: the same for the module as it
was when GRPO started (``freeze_baseline``), on the same states.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from splash_rollout.distributed.groups import average_gradients, sum_over_ranks
from splash_rollout.engine.mtp_drafter import coupled_drafts
from splash_rollout.recipes.grpo.micro_batches import plan_rank_micro_batches
from splash_rollout.recipes.grpo.trainer import TrainBatch, collate


@dataclass(frozen=True)
class MTPTrainingConfig:
    """The ``grpo.mtp`` group."""

    train: bool = True
    """Train the model's MTP modules during SFT and GRPO (a model without them: nothing to do)."""
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    measure_frozen: bool = True
    """Keep the module as it was after SFT and report its acceptance beside the trained one's."""
    measure_samples: int = 64
    """Samples of a step the acceptance is measured on (a forward of the decoder over them, no gradient)."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"grpo.mtp.lr: expected > 0, got {self.lr!r}")
        if not self.grad_clip >= 0:
            raise ValueError(f"grpo.mtp.grad_clip: expected >= 0, got {self.grad_clip!r}")


def mtp_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The MTP modules' parameters (what the policy's optimizer leaves out)."""
    layers = getattr(getattr(model, "model", None), "mtp_layers", None)
    return list(layers.parameters()) if layers is not None else []


class MTPTrainer:
    """The MTP modules of ``model`` (the trainer's module, shared with the policy), their optimizer
    and their step."""

    def __init__(self, model: nn.Module, config: MTPTrainingConfig, rank: int = 0, world_size: int = 1,
                 micro_batch_size: int = 64, micro_batch_tokens: int | None = None) -> None:
        self.model, self.config, self.rank, self.world_size = model, config, rank, world_size
        self.micro_batch_size, self.micro_batch_tokens = micro_batch_size, micro_batch_tokens
        self.params = mtp_parameters(model)
        self.optimizer = (torch.optim.AdamW(self.params, lr=config.lr, betas=config.betas, weight_decay=0.0)
                          if self.params else None)
        self.frozen: nn.ModuleList | None = None

    @property
    def active(self) -> bool:
        return self.config.train and bool(self.params)

    def freeze_baseline(self) -> None:
        """Keep a copy of the module as it is now (after SFT) to measure beside the trained one."""
        if self.active and self.config.measure_frozen:
            self.frozen = copy.deepcopy(self.model.model.mtp_layers).eval().requires_grad_(False)

    def state_dict(self) -> dict:
        """Its optimizer and its frozen baseline (what a checkpoint keeps; the weights are the model's)."""
        return {"optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                "frozen": self.frozen.state_dict() if self.frozen is not None else None}

    def load_state_dict(self, state: dict) -> None:
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if state.get("frozen") is not None and self.active:
            self.frozen = copy.deepcopy(self.model.model.mtp_layers).eval().requires_grad_(False)
            self.frozen.load_state_dict(state["frozen"])

    # ---- training: a term of the policy's forward and backward, then its own optimizer step ----------
    def loss(self, mtp_logits: torch.Tensor, batch: TrainBatch, normalizer: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The module's loss on a micro-batch, from its logits [B, S - 1, vocab] of the policy's forward
        (``mtp="detached"``: the gradient reaches the module alone), to add to the policy's loss: the
        next-next token's cross entropy over the trained tokens that have a draft (a trained token
        after a trained token: the first response token has none), summed / ``normalizer``. Also
        (summed cross entropy, tokens) for the report."""
        targets = batch.input_ids[:, 2:]  # row i predicts token i + 2
        drafted = (batch.loss_mask[:, 1:] > 0) & (batch.loss_mask[:, :-1] > 0)  # [B, S - 2]
        logits = mtp_logits[:, : targets.shape[1]][drafted]  # [drafted tokens, vocab]: the rows trained
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[drafted][:, None]).squeeze(-1)
        summed = -logprobs.sum()
        return summed / normalizer, torch.stack([summed.detach().double(), drafted.sum().double()]).cpu()

    @staticmethod
    def drafted_tokens(batch: TrainBatch) -> int:
        """The tokens ``loss`` trains on in ``batch`` (what the step's normalizer counts)."""
        return int(((batch.loss_mask[:, 1:] > 0) & (batch.loss_mask[:, :-1] > 0)).sum())

    def step(self, sums: torch.Tensor) -> dict[str, float]:
        """After the policy's step: the module's gradients (accumulated by ``loss`` terms) averaged over
        the ranks, clipped, one AdamW step. ``sums``: this rank's (cross entropy, tokens) summed over
        its micro-batches. Returns ``mtp/loss`` (the step's mean over every rank's tokens)."""
        if self.world_size > 1:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            average_gradients(self.params)
            sums = sum_over_ranks(sums, self.params[0].device)
        grads = [p for p in self.params if p.grad is not None]
        if self.config.grad_clip > 0 and grads:
            torch.nn.utils.clip_grad_norm_(grads, self.config.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"mtp/loss": float(sums[0] / max(float(sums[1]), 1.0))}

    # ---- measurement: how often its drafts would be kept ----------------------------------------------
    @torch.no_grad()
    def measure(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int,
                specs: Sequence | None = None) -> dict[str, float]:
        """``mtp/accept_top1`` (and with ``specs``, each sample's engine ``SamplingSpec``,
        ``mtp/accept_coupled``) of the module as it is, on the first ``measure_samples`` of these
        sequences (each rank its share, summed over the ranks), every response token from the second
        on; ``mtp_frozen/*`` the same for the module as GRPO found it. Call it before the module trains
        on them (the acceptance it would have had drafting them)."""
        if not self.active:
            return {}
        n = min(len(prompts), self.config.measure_samples)
        plan = plan_rank_micro_batches([len(prompts[i]) + len(responses[i]) for i in range(n)], self.rank,
                                       self.world_size, self.micro_batch_size, self.micro_batch_tokens)
        sums = torch.zeros(5, dtype=torch.float64)  # tokens, top1, coupled, frozen top1, frozen coupled
        for ids in plan:
            if ids:
                sums += self._measure(collate([prompts[i] for i in ids], [responses[i] for i in ids], pad_id),
                                      [specs[i] for i in ids] if specs is not None else None,
                                      [len(prompts[i]) for i in ids])
        if self.world_size > 1:
            sums = sum_over_ranks(sums, self.params[0].device)
        tokens, top1, coupled, f_top1, f_coupled = (float(x) for x in sums)
        tokens = max(tokens, 1.0)
        out = {"mtp/accept_top1": top1 / tokens}
        if specs is not None:
            out["mtp/accept_coupled"] = coupled / tokens
        if self.frozen is not None:
            out["mtp_frozen/accept_top1"] = f_top1 / tokens
            if specs is not None:
                out["mtp_frozen/accept_coupled"] = f_coupled / tokens
        return out

    def _measure(self, batch: TrainBatch, specs: list | None, prompt_lens: list[int]) -> torch.Tensor:
        model = self.model
        device = next(model.parameters()).device
        batch = batch.to(device)
        hidden, allowed = model._decoder(batch.input_ids, batch.attention_mask)
        state, embeds = model.model.norm(hidden), model.model.embed_tokens(batch.input_ids)
        s = batch.input_ids.shape[1]
        out = torch.zeros(5, dtype=torch.float64)
        if s < 3:
            return out
        head = model.lm_head.weight
        targets = batch.input_ids[:, 2:]
        # row i drafts response token k = i + 2 - prompt length; the first (k = 0) has none
        k = torch.arange(s - 2, device=device)[None, :] + 2 - torch.tensor(prompt_lens, device=device)[:, None]
        drafted = (batch.loss_mask[:, 1:] > 0) & (k >= 1)
        rows = drafted.nonzero(as_tuple=True)
        draws = k[rows].tolist()  # each drafted token's response index: its draw
        want = targets[rows]
        out[0] = want.numel()
        modules = [(model.model.mtp_layers[0], 1)] + ([(self.frozen[0], 3)] if self.frozen is not None else [])
        for layer, at in modules:
            logits = mtp_logits(layer, state, embeds, allowed, head)[:, : s - 2][rows]  # [drafted, vocab]
            out[at] = float((logits.argmax(-1) == want).sum())
            if specs is not None and want.numel():
                got = coupled_drafts(logits, [specs[b] for b in rows[0].tolist()], draws)
                out[at + 1] = float((got == want).sum())
        return out


def mtp_logits(layer: nn.Module, state: torch.Tensor, embeds: torch.Tensor, allowed: torch.Tensor,
               head: torch.Tensor) -> torch.Tensor:
    """One MTP module over a batch: state, embeds [B, S, hidden] (the decoder's final-normed states and
    the tokens' embeddings), allowed [B, S, S] -> logits [B, S - 1, vocab], row i for token i + 2."""
    s = state.shape[1]
    return layer.predict(embeds[:, 1:], state[:, :s - 1], torch.arange(s - 1, device=state.device),
                         allowed[:, :s - 1, :s - 1], head)[1]
