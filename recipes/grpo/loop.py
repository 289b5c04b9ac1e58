"""The GRPO loop. Every rank runs ``train``; only rank 0 logs.

    for step in range(steps):
        batch      = engine.generate(prompts, sampling)          # rollout (every rank: the whole batch)
        rewards    = verify(batch, answers)                      # reward
        advantages = group_advantages(rewards)                   # group-normalised
        stats      = grpo_update(trainer, batch, advantages)     # train (ZeRO-2 over the ranks)
        engine.update_weights(weights, version=step + 1)         # the engine samples the new policy
        sink.log(step_metrics(...), step)                        # log

``cfg`` is the composed Hydra config (see ``conf/``); it is turned into the library's frozen configs
here, at the edge. Outputs (rank 0): metrics.jsonl, timeline.json, timeline.png, samples.jsonl and
the W&B run, all under ``run_dir``.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import time
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from recipes.grpo.data import ChainTaskConfig, make_dataset
from recipes.grpo.loss import GRPOLossConfig, group_advantages, grpo_loss, token_logprobs
from recipes.grpo.reward import chain_score, parse_answer, score
from recipes.grpo.sft import SFTConfig, run_sft
from recipes.grpo.trainer import Trainer, TrainerConfig, collate
from splash_rollout.models.config import PRESETS, resolve_model
from splash_rollout.models.model import MLAForCausalLM
from splash_rollout.models.tokenizer import load_tokenizer
from splash_rollout.reporting import MetricsSink, NoOpSink, make_sink
from splash_rollout.reporting.timeline import TABLE_COLUMNS, layout_metrics, plot_timeline, table_rows, \
    write_timeline_json
from splash_rollout.rollout.config import EngineConfig
from splash_rollout.rollout.engine import RolloutEngine
from splash_rollout.rollout.types import RolloutBatch, SamplingParams


# ---- construction (Hydra config -> library objects) -------------------------------------------------
def model_source(cfg: DictConfig) -> str:
    return cfg.model.path or cfg.model.name


def build_policy(cfg: DictConfig) -> MLAForCausalLM:
    dtype = getattr(torch, cfg.model.dtype)
    source = model_source(cfg)
    if source in PRESETS:
        model = MLAForCausalLM.from_config(resolve_model(source), seed=cfg.seed, dtype=dtype)
    else:
        model = MLAForCausalLM.from_pretrained(source, dtype=dtype)
    return model.to(cfg.hardware.device)


def build_engine(cfg: DictConfig) -> RolloutEngine:
    e = cfg.engine
    kwargs = dict(model=model_source(cfg), world_size=e.world_size, dtype=cfg.model.dtype, seed=cfg.seed,
                  page_size=e.page_size, max_num_batched_tokens=e.max_num_batched_tokens,
                  max_num_seqs=e.max_num_seqs, memory_budget_gib=e.memory_budget_gib,
                  max_model_len=e.max_model_len, device=cfg.hardware.device,
                  attention_backend=e.attention_backend, tokenizer=cfg.model.tokenizer,
                  numerics=e.get("numerics", "fast"))
    if e.layout is not None:
        kwargs["layout"] = e.layout
    return RolloutEngine(EngineConfig(**kwargs))


def build_engine_with_weights(cfg: DictConfig, weights: dict[str, torch.Tensor]) -> RolloutEngine:
    """The engine over this run's ranks, holding ``weights`` as version 0."""
    engine = build_engine(cfg)
    engine.update_weights(weights, version=0)
    return engine


@contextmanager
def timed(timings: dict[str, float], key: str):
    t0 = time.perf_counter()
    yield
    timings[f"timing_s/{key}"] = time.perf_counter() - t0


# ---- the algorithm's pieces ------------------------------------------------------------------------
def verify(batch: RolloutBatch, rows: dict[str, list], tokenizer, reward_cfg: DictConfig) -> torch.Tensor:
    """[num_groups, n] rewards from the verifier (``reward.kind``: chain or answer)."""
    def one(text: str, i: int) -> float:
        if reward_cfg.kind == "chain":
            return chain_score(text, rows["answer"][i], rows["solution"][i], reward_cfg.answer_weight)
        return score(text, rows["answer"][i], reward_cfg.format_reward)
    return torch.tensor([[one(tokenizer.decode(s.response_ids), g.prompt_index) for s in g.samples]
                         for g in batch.groups], dtype=torch.float32)


def grpo_update(trainer: Trainer, batch: RolloutBatch, advantages: torch.Tensor, loss_config: GRPOLossConfig,
                minibatches: int, micro_batch_size: int, pad_id: int,
                ref_model: torch.nn.Module | None = None) -> dict[str, float]:
    """``minibatches`` optimizer steps over the rollout batch; this rank trains on samples
    ``rank::world`` of each minibatch. The loss is the token mean over the whole minibatch (all ranks)."""
    samples = batch.samples
    adv = advantages.flatten().tolist()
    order = list(range(len(samples)))
    per_mb = -(-len(order) // minibatches)
    stats_all: list[dict[str, float]] = []
    for m in range(minibatches):
        idx = order[m * per_mb:(m + 1) * per_mb]
        normalizer = sum(sum(samples[i].loss_mask) for i in idx) / trainer.world_size
        mine = sorted(idx[trainer.rank::trainer.world_size], key=lambda i: len(samples[i].response_ids))
        micro = []
        for k in range(0, len(mine), micro_batch_size):
            chunk = [samples[i] for i in mine[k:k + micro_batch_size]]
            mb = collate([s.prompt_ids for s in chunk], [s.response_ids for s in chunk], pad_id,
                         response_mask=[s.loss_mask for s in chunk],
                         per_token={"old_logprobs": [s.response_logprobs for s in chunk]},
                         per_sample={"advantages": [adv[i] for i in mine[k:k + micro_batch_size]]})
            if ref_model is not None:
                with torch.no_grad():
                    dev = trainer.device
                    logits = ref_model(mb.input_ids.to(dev), mb.attention_mask.to(dev))[:, :-1]
                    mb.extras["ref_logprobs"] = token_logprobs(logits, mb.targets.to(dev), trainer.temperature).cpu()
            micro.append(mb)

        def loss_fn(logprobs, mb):
            mask = mb.loss_mask
            loss, stats = grpo_loss(logprobs, mb.extras["old_logprobs"], mb.extras["advantages"], mask,
                                    loss_config, mb.extras.get("ref_logprobs"), normalizer=normalizer)
            # rollout vs trainer logprobs of the same tokens (weights equal before the first step)
            stats["logprob_diff_max"] = ((logprobs - mb.extras["old_logprobs"]).abs() * mask).max().detach()
            return loss, stats

        stats_all.append(trainer.optimizer_step(micro, loss_fn))
    out = {f"train/{k}": float(np.mean([s[k] for s in stats_all])) for k in stats_all[0] if k in stats_all[-1]}
    out["train/logprob_diff_max"] = stats_all[0]["logprob_diff_max"]  # on-policy pass: must be ~0
    return out


def answer_accuracy(batch: RolloutBatch, answers: list[int], tokenizer) -> float:
    """Fraction of samples whose final answer is right (whatever the reward's kind)."""
    return float(np.mean([parse_answer(tokenizer.decode(s.response_ids)) == answers[g.prompt_index]
                          for g in batch.groups for s in g.samples]))


def step_metrics(batch: RolloutBatch, rewards: torch.Tensor, accuracy: float,
                 timings: dict[str, float]) -> dict[str, float]:
    """One record per RL step under slash keys: rollout/*, reward/*, perf/*, layout/*, timing_s/*."""
    lens = np.array([len(s.response_ids) for s in batch.samples], dtype=np.float64)
    reasons = [s.finish_reason for s in batch.samples]
    timeline = batch.timeline.to_dict()
    tokens = float(lens.sum())
    gen_s = timings.get("timing_s/rollout", 0.0)
    group_std = rewards.std(dim=-1, unbiased=False)
    out = {"rollout/response_len/mean": float(lens.mean()), "rollout/response_len/max": float(lens.max()),
           "rollout/response_len/min": float(lens.min()), "rollout/response_len/p90": float(np.percentile(lens, 90)),
           "rollout/num_samples": float(len(lens)),
           "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std(unbiased=False)),
           "reward/accuracy": accuracy,
           "reward/groups_with_signal": float((group_std > 0).float().mean()),
           "perf/tokens_per_s": tokens / max(gen_s, 1e-9), "perf/rollout_tokens": tokens,
           "perf/engine_steps": float(sum(p.get("steps", 0) for p in timeline["phases"]))}
    for r in ("stop", "length", "abort"):
        out[f"rollout/finish_reason/{r}"] = reasons.count(r) / len(reasons)
    out.update(layout_metrics(timeline))
    out.update(timings)
    return out


# ---- the loop --------------------------------------------------------------------------------------
def train(cfg: DictConfig, run_dir: str, rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """SFT warm start, then ``cfg.grpo.steps`` GRPO steps. Returns the per-step metrics (rank 0)."""
    t_start = time.perf_counter()
    hw = cfg.hardware
    if hw.threads:
        torch.set_num_threads(int(hw.threads))
    if hw.flush_denormal:
        torch.set_flush_denormal(True)  # softmax tails go denormal; CPU matmuls slow down ~7x otherwise
    if str(hw.device).startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))  # engine and trainer: this rank's GPU
    torch.manual_seed(cfg.seed)
    os.makedirs(run_dir, exist_ok=True)
    tokenizer = load_tokenizer(cfg.model.tokenizer or model_source(cfg))
    g = cfg.grpo
    sink: MetricsSink = (make_sink(cfg.logger.kind, rank, run_dir, project=cfg.logger.project,
                                   name=cfg.logger.name, mode=cfg.logger.mode, entity=cfg.logger.entity,
                                   config=OmegaConf.to_container(cfg, resolve=True))
                         if rank == 0 else NoOpSink())
    policy = build_policy(cfg)
    s = cfg.sft
    if s.get("load"):  # a saved warm start (sft_policy.pt of an earlier run) replaces SFT
        # before the trainer exists: ZeRO keeps its own fp32 master copy of the parameters, taken at
        # deepspeed.initialize, and would overwrite weights loaded into the module afterwards
        policy.load_state_dict(torch.load(s.load, map_location="cpu"), strict=True)
    trainer = Trainer(policy, TrainerConfig(
        backend=cfg.trainer.backend, zero_stage=cfg.trainer.zero_stage, lr=cfg.trainer.lr,
        weight_decay=cfg.trainer.weight_decay, betas=tuple(cfg.trainer.betas), grad_clip=cfg.trainer.grad_clip,
        micro_batch_size=cfg.trainer.micro_batch_size, dist_backend=cfg.trainer.dist_backend),
        rank=rank, world_size=world_size, temperature=g.temperature)
    task = ChainTaskConfig(**OmegaConf.to_container(cfg.data.task, resolve=True))
    d = cfg.data

    sft_config = SFTConfig(steps=s.steps, batch_size=s.batch_size, lr=s.lr, warmup_steps=s.warmup_steps,
                           min_lr_ratio=s.min_lr_ratio, log_every=s.log_every)
    sft_summary = {}
    if not s.get("load") and sft_config.steps > 0:
        sft_data = make_dataset(sft_config.steps * sft_config.batch_size, d.sft_seed, task)
        sft_summary = run_sft(trainer, tokenizer, sft_data, sft_config, cfg.trainer.micro_batch_size,
                              log=lambda m, i: log_sft(sink, m, i, rank, cfg.logger.log_sft))
        if rank == 0 and s.get("save", True):
            torch.save(trainer.named_weights(), os.path.join(run_dir, "sft_policy.pt"))
        trainer.reset_optimizer_state()  # GRPO starts with fresh Adam moments, as after sft.load
    ref_model = None
    if g.kl_coef > 0:
        ref_model = copy.deepcopy(trainer.model).eval().requires_grad_(False)
    engine = build_engine_with_weights(cfg, trainer.named_weights())

    loss_config = GRPOLossConfig(clip_low=g.clip_low, clip_high=g.clip_high, kl_coef=g.kl_coef,
                                 normalize_std=g.normalize_std)
    # fresh prompts every step, or a fixed pool cycled in epochs (data.grpo_pool_size)
    pool = d.get("grpo_pool_size") or g.steps * g.prompts_per_step
    prompts = make_dataset(pool, d.grpo_seed, task)
    sampling = SamplingParams(n=g.n, temperature=g.temperature, top_p=g.top_p, max_new_tokens=g.max_new_tokens,
                              stop_token_ids=tuple(tokenizer.eos_token_ids))
    step_offset = sft_config.steps if cfg.logger.log_sft else 0
    history, timelines = [], []
    samples_file = open(os.path.join(run_dir, "samples.jsonl"), "w") if rank == 0 else None
    for step in range(g.steps):
        timings: dict[str, float] = {}
        first = (step * g.prompts_per_step) % len(prompts)
        rows = prompts.select([(first + i) % len(prompts) for i in range(g.prompts_per_step)])[:]
        trainer.set_lr(cfg.trainer.lr * min(1.0, (step + 1) / max(1, g.warmup_steps)))
        with timed(timings, "rollout"):
            batch = engine.generate([tokenizer.encode(p) for p in rows["prompt"]],
                                    dataclasses.replace(sampling, seed=cfg.seed * 100_003 + step))
        with timed(timings, "reward"):
            rewards = verify(batch, rows, tokenizer, g.reward)
        advantages = group_advantages(rewards, loss_config.adv_eps, loss_config.normalize_std)
        with timed(timings, "train"):
            train_stats = grpo_update(trainer, batch, advantages, loss_config, g.minibatches,
                                      cfg.trainer.micro_batch_size, tokenizer.pad_token_id, ref_model)
        with timed(timings, "push_weights"):
            engine.update_weights(trainer.named_weights(), version=step + 1)
        timings["timing_s/step"] = sum(timings.values())
        accuracy = answer_accuracy(batch, rows["answer"], tokenizer)
        metrics = {**step_metrics(batch, rewards, accuracy, timings), **train_stats, "grpo_step": float(step)}
        sink.log(metrics, step=step_offset + step)
        history.append(metrics)
        timelines.append((step, batch.timeline.to_dict()))
        if samples_file is not None:
            write_samples(samples_file, step, batch, rows, rewards, tokenizer, cfg.logger.samples_per_step)
        if rank == 0:
            print(f"[grpo] step {step:3d} reward {metrics['reward/mean']:.3f} acc {metrics['reward/accuracy']:.3f} "
                  f"len {metrics['rollout/response_len/mean']:.1f}/{metrics['rollout/response_len/max']:.0f} "
                  f"tok/s {metrics['perf/tokens_per_s']:.0f} step {timings['timing_s/step']:.1f}s", flush=True)

    summary: dict[str, Any] = {"history": history, "sft": sft_summary}
    if rank == 0:
        samples_file.close()
        write_timeline_json(os.path.join(run_dir, "timeline.json"), timelines)
        png = plot_timeline(os.path.join(run_dir, "timeline.png"), timelines)
        last = step_offset + g.steps - 1
        sink.log_table("timeline/phases", TABLE_COLUMNS, [r for s_, t in timelines for r in table_rows(s_, t)], last)
        sink.log_image("timeline/plot", png, last)
        summary.update(reward_summary(history, cfg.grpo.summary_window),
                       total_s=time.perf_counter() - t_start)
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump({k: v for k, v in summary.items() if k != "history"}, f, indent=1)
        print(f"[grpo] done in {summary['total_s']:.0f}s: reward first {summary['reward/first']:.3f} "
              f"-> last {summary['reward/last']:.3f}; outputs in {run_dir}", flush=True)
    sink.finish()
    engine.shutdown()
    return summary


def log_sft(sink: MetricsSink, metrics: dict[str, float], step: int, rank: int, to_sink: bool) -> None:
    if to_sink:
        sink.log(metrics, step=step)
    if rank == 0:
        print(f"[sft] step {step:4d} loss {metrics['sft/loss']:.3f} lr {metrics['sft/lr']:.2e} "
              f"{metrics['timing_s/sft']:.0f}s", flush=True)


def reward_summary(history: list[dict[str, float]], window: int) -> dict[str, float]:
    rewards = [h["reward/mean"] for h in history]
    w = max(1, min(window, len(rewards) // 2 or 1))
    return {"reward/first": float(np.mean(rewards[:w])), "reward/last": float(np.mean(rewards[-w:])),
            "reward/curve": rewards}


def write_samples(f, step: int, batch: RolloutBatch, rows: dict, rewards: torch.Tensor, tokenizer, k: int) -> None:
    """The first sample of the first ``k`` groups: prompt, completion, reward, finish reason."""
    for g in batch.groups[:k]:
        s = g.samples[0]
        f.write(json.dumps({"step": step, "prompt": rows["prompt"][g.prompt_index],
                            "answer": rows["answer"][g.prompt_index],
                            "completion": tokenizer.decode(s.response_ids), "reward": float(rewards[g.prompt_index, 0]),
                            "finish_reason": s.finish_reason, "response_len": len(s.response_ids)}) + "\n")
    f.flush()
