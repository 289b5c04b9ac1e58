"""The GRPO loop. Every rank runs ``train``; only rank 0 logs.

    run = set_up(cfg)                                                # setup.py: checks, data, SFT, trainer, engine
    for step in range(run.start, steps):
        eval       = run.evaluate(step)                              # held-out greedy accuracy when due
        groups     = run.rollout.generate(engine, sampling)          # rollout (every rank: the whole batch)
        rewards    = run.rollout.rewards(groups)                     # reward.fn
        advantages = supervision.advantages(shape(rewards))          # per sample, or per token (process)
        mtp_stats  = run.mtp.measure(groups.batch)                   # the MTP module's drafts of it: kept?
        stats      = grpo_update(trainer, groups.batch, advantages)  # train (ZeRO-2 over the ranks), MTP too
        engine.update_weights(weights, version=step + 1)             # the engine samples the new policy
        log_step(...); run.save_if_due(step)                         # metrics.jsonl, W&B; resume=<run dir>
    finish(run)                                                      # final eval, timeline, reward.png, summary

Optional behaviour is a strategy chosen at setup, not a branch here: where a step's groups come from
(``StepRollout``, step_rollout.py: plain, over-sampled with dynamic filtering, partial rollout) and
what the engine's memory does while the trainer steps (``EngineMemory``, engine_memory.py). Outputs
(rank 0): metrics.jsonl, timeline.json, timeline.png, reward.png, samples.jsonl, summary.json,
checkpoints/ and the W&B run, all under ``run_dir``. With held-out eval, eval_correct.jsonl keeps
each eval's per-prompt 1/0, and the after-SFT vs after-GRPO paired comparison is printed and kept as
summary.json's ``eval/paired``.
"""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from splash_rollout.recipes.grpo.build import build_engine, build_engine_with_weights, build_policy
from splash_rollout.recipes.grpo.evaluation import paired_comparison
from splash_rollout.recipes.grpo.metrics import step_metrics
from splash_rollout.recipes.grpo.plots import moving_average, plot_reward
from splash_rollout.recipes.grpo.setup import GRPORun, set_up, truncate_jsonl
from splash_rollout.recipes.grpo.step_rollout import StepGroups
from splash_rollout.recipes.grpo.task_data import Example
from splash_rollout.recipes.grpo.update import grpo_update, reference_logprobs, shape_rewards
from splash_rollout.reporting.timeline_report import TABLE_COLUMNS, plot_timeline, table_rows, write_timeline_json
from splash_rollout.rollout.types import RolloutBatch

__all__ = ["train", "build_engine", "build_policy", "build_engine_with_weights"]


@contextmanager
def timed(timings: dict[str, float], key: str):
    t0 = time.perf_counter()
    yield
    timings[f"timing_s/{key}"] = time.perf_counter() - t0


def train(cfg: DictConfig, run_dir: str, rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """SFT warm start (or a checkpoint), then GRPO steps up to ``cfg.grpo.steps``. Returns the
    per-step metrics (rank 0)."""
    run = set_up(cfg, run_dir, rank, world_size)
    engine, trainer = run.engine, run.trainer
    for step in range(run.start, run.steps):
        timings: dict[str, float] = {}
        extra = {**run.evaluate(step), **(run.data.metrics() if step == 0 else {})}
        trainer.set_lr(run.schedule.lr_at(step))
        with timed(timings, "rollout"):  # with over-sampling this includes scoring the groups
            groups = run.rollout.generate(engine, run.sampling_for(step))
        if not groups.batch.groups:  # every group filtered out: nothing to train on
            log_untrained(run, step, groups, {**timings, **extra})
            continue
        with timed(timings, "reward"):
            scored = run.rollout.rewards(groups)
            rewards = torch.tensor(scored.reward, dtype=torch.float32).view(len(groups.batch.groups), run.sampling.n)
            shaped, shape_stats = shape(run, rewards, groups.batch)  # overlong, KL in the reward
        advantages = run.supervision.advantages(shaped, scored, groups.batch, run.tokenizer)
        memory = run.engine_memory.before_train(engine)
        with timed(timings, "measure_mtp"):  # how often its drafts of this rollout would have been kept
            samples = groups.batch.samples
            mtp_stats = run.mtp.measure([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                                        run.tokenizer.pad_token_id, [s.spec for s in samples])
        with timed(timings, "train"):  # the policy, and the MTP module on the same forward
            train_stats = grpo_update(trainer, groups.batch, advantages, run.update, run.tokenizer.pad_token_id,
                                      step, run.ref_model, policy_version=groups.policy_version, mtp=run.mtp)
        with timed(timings, "push_weights"):
            run.engine_memory.before_push(engine)
            engine.update_weights(trainer.named_weights(), version=step + 1)
        timings["timing_s/step"] = sum(timings.values())
        metrics = {**step_metrics(groups.batch, rewards, scored, timings), **shape_stats, **train_stats, **mtp_stats,
                   **memory,
                   **extra, **groups.oversample_counts, **groups.partial_counts,
                   "train/lr": run.schedule.lr_at(step), "grpo_step": float(step)}
        log_step(run, step, metrics, groups, rewards)
        run.save_if_due(step)
    return finish(run)


def shape(run: GRPORun, rewards: torch.Tensor, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Rewards as the advantages see them: overlong handling, and the KL to the reference when it
    is charged in the reward (``grpo.kl_in=reward``)."""
    ref_lp = None
    if run.ref_model is not None and run.update.kl_in == "reward":
        ref_lp = reference_logprobs(run.ref_model, batch.samples, run.tokenizer.pad_token_id,
                                    run.update.micro_batch_size, run.trainer.temperature, run.trainer.device,
                                    run.update.micro_batch_tokens)
    return shape_rewards(rewards, batch, run.update, ref_lp)


def log_untrained(run: GRPORun, step: int, groups: StepGroups, extra: dict[str, float]) -> None:
    metrics = {**groups.oversample_counts, **groups.partial_counts, **extra, "grpo_step": float(step)}
    run.sink.log(metrics, step=run.step_offset + step)
    if run.rank == 0:
        print(f"[grpo] step {step:3d}: no group passed grpo.filter={run.rollout.oversample.filter}; no update",
              flush=True)


def log_step(run: GRPORun, step: int, metrics: dict[str, float], groups: StepGroups, rewards: torch.Tensor) -> None:
    """The step's metrics (with reward/mean_ma), its timeline, its samples and one line on stdout."""
    run.past_rewards.append(metrics["reward/mean"])
    metrics["reward/mean_ma"] = moving_average(run.past_rewards[-run.ma_window:], run.ma_window)[-1]
    run.sink.log(metrics, step=run.step_offset + step)
    run.timelines.append((step, groups.batch.timeline.to_dict()))
    if run.samples_file is not None:
        write_samples(run.samples_file, step, groups.batch, groups.examples, rewards, run.tokenizer,
                      run.samples_per_step)
    if run.rank == 0:
        print(f"[grpo] step {step:3d} reward {metrics['reward/mean']:.3f} acc {metrics['reward/accuracy']:.3f} "
              f"len {metrics['rollout/response_len/mean']:.1f}/{metrics['rollout/response_len/max']:.0f} "
              f"tok/s {metrics['perf/tokens_per_s']:.0f} step {metrics['timing_s/step']:.1f}s", flush=True)


def finish(run: GRPORun) -> dict[str, Any]:
    """The final eval and paired comparison, then (rank 0) timeline.json/png, reward.png, summary.json
    and the closing lines; stops the engine. Returns the summary (with the history on rank 0)."""
    steps, rank, sink = run.steps, run.rank, run.sink
    final_eval = run.evaluate(steps) if run.start < steps else {}
    paired = paired_eval(run.eval_file, steps) if rank == 0 and final_eval else None
    if final_eval:
        final_eval.update({f"eval/paired/{k}": float(v) for k, v in (paired or {}).items()})
        sink.log({**final_eval, "grpo_step": float(steps)}, step=run.step_offset + steps)

    summary: dict[str, Any] = {"sft": run.sft_summary}
    if rank == 0:
        run.samples_file.close()
        run_dir, timelines = run.run_dir, run.timelines
        history = truncate_jsonl(os.path.join(run_dir, "metrics.jsonl"), lambda r: True)
        write_timeline_json(os.path.join(run_dir, "timeline.json"), timelines)
        png = plot_timeline(os.path.join(run_dir, "timeline.png"), timelines)
        # at the step the final eval went to (W&B drops anything logged at a step below its latest)
        at = run.step_offset + steps
        sink.log_table("timeline/phases", TABLE_COLUMNS, [r for s_, t in timelines for r in table_rows(s_, t)], at)
        sink.log_image("timeline/plot", png, at)
        sink.log_image("reward/plot", plot_reward(os.path.join(run_dir, "reward.png"), history, run.ma_window, paired),
                       at)
        summary.update(**reward_summary([h for h in history if "reward/mean" in h], run.summary_window),
                       **eval_summary(history), **run.data.metrics(), total_s=time.perf_counter() - run.t_start)
        if paired:
            summary["eval/paired"] = paired
        if run.rollout.carry is not None:  # cut off in the last step: never trained (nor dropped)
            summary["rollout/carried_at_end"] = float(len(run.rollout.carry.groups))
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        summary["history"] = history
        curve = (f"reward first {summary['reward/first']:.3f} -> last {summary['reward/last']:.3f}"
                 if "reward/first" in summary else "no step trained")
        if paired:
            print(f"[eval] after GRPO vs after SFT, {paired['prompts']} held-out prompts: accuracy "
                  f"{paired['accuracy_before']:.3f} -> {paired['accuracy_after']:.3f}, gained {paired['gained']}, "
                  f"lost {paired['lost']}, paired exact p = {paired['p_value']:.2g}", flush=True)
        print(f"[grpo] done in {summary['total_s']:.0f}s: {curve}; outputs in {run_dir}", flush=True)
    sink.finish()
    run.engine.shutdown()
    return summary


def paired_eval(path: str, last_step: int) -> dict[str, float] | None:
    """The first eval of the run (before GRPO step 0: the post-SFT policy) against the one after
    the last step, prompt by prompt; None unless both are in ``path`` (eval_correct.jsonl)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        rows = {r["grpo_step"]: r["correct"] for r in map(json.loads, filter(str.strip, f))}
    if 0 not in rows or last_step not in rows or last_step == 0:
        return None
    return paired_comparison(rows[0], rows[last_step])


def reward_summary(history: list[dict[str, float]], window: int) -> dict[str, Any]:
    rewards = [h["reward/mean"] for h in history]
    if not rewards:
        return {}
    w = max(1, min(window, len(rewards) // 2 or 1))
    return {"reward/first": float(np.mean(rewards[:w])), "reward/last": float(np.mean(rewards[-w:])),
            "reward/curve": rewards}


def eval_summary(history: list[dict[str, float]]) -> dict[str, Any]:
    """The held-out curve: (GRPO step before which it ran, accuracy), and its first and last values."""
    curve = [(int(h["grpo_step"]), h["eval/accuracy"]) for h in history if "eval/accuracy" in h]
    if not curve:
        return {}
    return {"eval/accuracy_curve": curve, "eval/accuracy_first": curve[0][1], "eval/accuracy_last": curve[-1][1]}


def write_samples(f, step: int, batch: RolloutBatch, examples: list[Example], rewards: torch.Tensor, tokenizer,
                  k: int) -> None:
    """The first sample of the first ``k`` groups: prompt, completion, reward, finish reason."""
    for row, g in enumerate(batch.groups[:k]):
        s, ex = g.samples[0], examples[g.prompt_index]
        label = ex.label if isinstance(ex.label, (int, float, str, bool, type(None))) else str(ex.label)
        f.write(json.dumps({"step": step, "prompt": tokenizer.decode(s.prompt_ids), "answer": label,
                            "completion": tokenizer.decode(s.response_ids), "reward": float(rewards[row, 0]),
                            "finish_reason": s.finish_reason, "response_len": len(s.response_ids)}) + "\n")
    f.flush()
