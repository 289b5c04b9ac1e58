"""The model's MTP module trained alongside the policy, so its drafts follow the policy they draft for.

Why: drafts from the MTP module (models/mtp.py) are only worth what it predicts of the *current*
policy's text; one left at its post-SFT weights drafts what an older policy would have written while
GRPO moves on (the GLM team's slime keeps it training during RL for this reason). Here:

* its own AdamW over the MTP parameters only, and its own step after each policy step on the same
  sequences -- the policy's loss, gradient clipping and optimizer never see it, so the policy trains
  token for token as it would without it (``Trainer`` leaves the MTP parameters out);
* its inputs are the decoder's final-normed states and the shared embedding, and its head the shared
  LM head, all without gradient: it learns to predict the policy, never the policy to suit it;
* its loss is the cross entropy of the token two ahead over the trained tokens (SFT: the reference
  solutions; GRPO: the rollout's responses), averaged over them;
* each rank trains on its share of the sequences and the module's gradients are averaged over the
  ranks, so its replicas stay equal.

Reported per step: ``mtp/loss``; ``mtp/accept_top1``, the share of response tokens (from the second
on: the first has no draft) that equal the module's argmax -- an argmax draft kept; with the
samples' sampling settings (GRPO), ``mtp/accept_coupled``, the share equal to the token the engine's
sampler draws from the module's distribution with the sample's own uniform for that token (sampler
and draws: engine/sampler.py, engine/random_draws.py) -- a draft that shares the sample's
randomness, kept whenever the two distributions put that uniform on the same token. ``mtp_frozen/*``:
the same for the module as it was after SFT (``freeze_baseline``), measured on the same states.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from splash_rollout.distributed.groups import average_gradients
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

    # ---- a step -------------------------------------------------------------------------------------
    def learn(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int,
              masks: Sequence[Sequence[int]] | None = None, specs: Sequence | None = None) -> dict[str, float]:
        """One optimizer step of the MTP modules on these sequences (this rank's share of them; every
        rank calls it with all of them). ``masks``: which response tokens are trained (default all);
        ``specs``: each sample's engine ``SamplingSpec`` (seed, temperature, truncation), for the
        coupled acceptance. Returns the step's ``mtp/*`` (and ``mtp_frozen/*``) metrics, averaged over
        the ranks' tokens."""
        if not self.active:
            return {}
        masks = masks if masks is not None else [[1] * len(r) for r in responses]
        plan = plan_rank_micro_batches([len(p) + len(r) for p, r in zip(prompts, responses)], self.rank,
                                       self.world_size, self.micro_batch_size, self.micro_batch_tokens)
        trained = sum(sum(m[1:]) for m in masks) / self.world_size  # the second response token on has a draft
        sums = torch.zeros(8, dtype=torch.float64)  # loss, tokens, top1, coupled, coupled tokens, frozen x3
        self.optimizer.zero_grad(set_to_none=True)
        for ids in plan:
            if not ids:
                continue
            batch = collate([prompts[i] for i in ids], [responses[i] for i in ids], pad_id,
                            response_mask=[masks[i] for i in ids])
            sums += self._micro_step(batch, [specs[i] for i in ids] if specs is not None else None,
                                     [len(prompts[i]) for i in ids], max(trained, 1.0))
        if self.world_size > 1:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            average_gradients(self.params)
            sums = _summed_over_ranks(sums, self.params[0].device)
        if self.config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in self.params if p.grad is not None], self.config.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss, tokens, top1, coupled, coupled_n, f_top1, f_coupled, _ = sums.tolist()
        out = {"mtp/loss": loss / max(tokens, 1.0), "mtp/accept_top1": top1 / max(tokens, 1.0)}
        if coupled_n:
            out["mtp/accept_coupled"] = coupled / coupled_n
        if self.frozen is not None:
            out["mtp_frozen/accept_top1"] = f_top1 / max(tokens, 1.0)
            if coupled_n:
                out["mtp_frozen/accept_coupled"] = f_coupled / coupled_n
        return out

    def _micro_step(self, batch: TrainBatch, specs: list | None, prompt_lens: list[int],
                    normalizer: float) -> torch.Tensor:
        model = self.model
        device = next(model.parameters()).device
        batch = batch.to(device)
        with torch.no_grad():
            hidden, allowed = model._decoder(batch.input_ids, batch.attention_mask)
            state = model.model.norm(hidden)
            embeds = model.model.embed_tokens(batch.input_ids)
        s = batch.input_ids.shape[1]
        if s < 3:
            return torch.zeros(8, dtype=torch.float64)
        head = model.lm_head.weight.detach()
        logits = mtp_logits(model.model.mtp_layers[0], state, embeds, allowed, head)[:, :s - 2]  # [B, S-2, V]
        targets = batch.input_ids[:, 2:]  # row i predicts token i + 2
        # row i drafts response token k = i + 2 - prompt length; the first (k = 0) has no draft
        k = torch.arange(s - 2, device=device)[None, :] + 2 - torch.tensor(prompt_lens, device=device)[:, None]
        drafted = (batch.loss_mask[:, 1:] > 0) & (k >= 1)  # [B, S - 2]: a trained response token with a draft
        mask = drafted.to(torch.float32)
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)
        loss = -(logprobs * mask).sum() / normalizer
        loss.backward()
        out = torch.zeros(8, dtype=torch.float64)
        out[0] = float(-(logprobs.detach() * mask).sum())
        out[1] = float(drafted.sum())
        out[2] = float(((logits.argmax(-1) == targets) & drafted).sum())
        frozen_logits = None
        if self.frozen is not None:
            with torch.no_grad():
                frozen_logits = mtp_logits(self.frozen[0], state, embeds, allowed, head)[:, :s - 2]
            out[5] = float(((frozen_logits.argmax(-1) == targets) & drafted).sum())
        if specs is not None:
            rows = drafted.nonzero(as_tuple=True)
            draws = k[rows].tolist()  # the response index of each drafted token: its draw
            if rows[0].numel():
                got = coupled_drafts(logits.detach()[rows], [specs[b] for b in rows[0].tolist()], draws)
                want = targets[rows]
                out[3], out[4] = float((got == want).sum()), float(want.numel())
                if frozen_logits is not None:
                    got_f = coupled_drafts(frozen_logits[rows], [specs[b] for b in rows[0].tolist()], draws)
                    out[6] = float((got_f == want).sum())
        return out


def mtp_logits(layer: nn.Module, state: torch.Tensor, embeds: torch.Tensor, allowed: torch.Tensor,
               head: torch.Tensor) -> torch.Tensor:
    """One MTP module over a batch: state, embeds [B, S, hidden] (the decoder's final-normed states and
    the tokens' embeddings), allowed [B, S, S] -> logits [B, S - 1, vocab], row i for token i + 2."""
    s = state.shape[1]
    x = layer.combine(embeds[:, 1:], state[:, :s - 1])
    out, _ = layer(x, torch.arange(s - 1, device=state.device), allowed[:, :s - 1, :s - 1], None)
    return torch.nn.functional.linear(layer.shared_head.norm(out), head)


def coupled_drafts(logits: torch.Tensor, specs: list, draw_index: list[int]) -> torch.Tensor:
    """logits [R, V] (a draft model's), each row's sample settings and response index -> [R] the token
    the engine's sampler draws from them with that sample's uniform for that token."""
    from splash_rollout.engine.sampler import SamplingBatch, sample_torch

    tokens, _ = sample_torch(logits.float(), SamplingBatch.make(specs, draw_index, device=logits.device))
    return tokens


def _summed_over_ranks(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    import torch.distributed as dist

    out = values.to(device)
    dist.all_reduce(out)
    return out.cpu()
