"""SFT warm start: a few hundred steps of teacher forcing on the task's reference solutions, so the
random-init policy already produces well-formed, sometimes-right answers and GRPO groups carry signal.
Runs on the same ``Trainer`` (same ranks, same optimizer engine) as GRPO; each rank trains on its
slice of every batch."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from splash_rollout.recipes.grpo.micro_batches import plan_rank_micro_batches
from splash_rollout.recipes.grpo.task_data import Example
from splash_rollout.recipes.grpo.trainer import Trainer, TrainBatch, collate


@dataclass(frozen=True)
class SFTConfig:
    steps: int = 200
    batch_size: int = 32
    """Sequences per optimizer step over all ranks."""
    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    """Cosine decay from lr to lr * min_lr_ratio."""
    log_every: int = 25


def lr_at(step: int, config: SFTConfig) -> float:
    warm = min(1.0, (step + 1) / max(1, config.warmup_steps))
    progress = step / max(1, config.steps)
    cos = config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return config.lr * warm * cos


def nll_loss(normalizer: float) -> Callable[[torch.Tensor, TrainBatch], tuple[torch.Tensor, dict]]:
    def loss_fn(logprobs: torch.Tensor, batch: TrainBatch):
        mask = batch.loss_mask.to(logprobs.device)
        return -(logprobs * mask).sum() / normalizer, {}
    return loss_fn


def run_sft(trainer: Trainer, tokenizer, examples: Sequence[Example], config: SFTConfig, micro_batch_size: int,
            log: Callable[[dict[str, float], int], None] | None = None,
            targets: Callable[[Example], tuple[list[int], list[int]]] | None = None,
            micro_batch_tokens: int | None = None, mtp=None) -> dict[str, float]:
    """Train on ``prompt ids -> target<eos>`` (``Example.prompt_ids`` as the engine will see them,
    so a chat template's ids are what SFT teaches), cycling through ``examples``; returns the last
    logged loss and the time taken. ``targets(example) -> (ids, loss mask)`` replaces the target
    (eos included), e.g. a tool demonstration whose environment replies carry mask 0. ``mtp``: an
    ``MTPTrainer`` whose module learns the same sequences in the same steps (mtp_training.py), its
    acceptance measured at the logged steps before it trains on them."""
    eos = tokenizer.eos_token_ids[0]
    rank, world = trainer.rank, trainer.world_size
    t0, last = time.perf_counter(), {}
    for step in range(config.steps):
        start = (step * config.batch_size) % len(examples)
        rows = [examples[(start + i) % len(examples)] for i in range(config.batch_size)]
        prompts = [ex.prompt_ids for ex in rows]
        if targets is None:
            responses = [tokenizer.encode(ex.target) + [eos] for ex in rows]
            masks = [[1] * len(r) for r in responses]
        else:
            responses, masks = map(list, zip(*(targets(ex) for ex in rows)))
        # token mean over the whole batch (all ranks); gradients are averaged over ranks, hence * world
        normalizer = sum(sum(m) for m in masks) / world
        # every rank runs as many micro-batches as the rank with the most; an empty one trains nothing
        plan = plan_rank_micro_batches([len(p) + len(r) for p, r in zip(prompts, responses)], rank, world,
                                       micro_batch_size, micro_batch_tokens)
        micro = [collate([prompts[i] for i in ids or [0]], [responses[i] for i in ids or [0]], tokenizer.pad_token_id,
                         response_mask=[masks[i] for i in ids] if ids else [[0] * len(masks[0])])
                 for ids in plan]
        trainer.set_lr(lr_at(step, config))
        logged = log is not None and (step % config.log_every == 0 or step == config.steps - 1)
        measured = mtp.measure(prompts, responses, tokenizer.pad_token_id) if logged and mtp is not None else {}
        stats = trainer.optimizer_step(micro, nll_loss(normalizer), temperature=1.0, mtp=mtp)
        if logged:
            mtp_stats = {k: v for k, v in stats.items() if k.startswith("mtp")} | measured
            last = {"sft/loss": stats["loss"], "sft/grad_norm": stats["grad_norm"], "sft/lr": lr_at(step, config),
                    **{f"sft/{k}": v for k, v in mtp_stats.items()}, "timing_s/sft": time.perf_counter() - t0}
            log(last, step)
    return {**last, "timing_s/sft": time.perf_counter() - t0}
