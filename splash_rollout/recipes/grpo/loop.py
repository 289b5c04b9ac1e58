"""The GRPO loop. Every rank runs ``train``; only rank 0 logs.

    for step in range(start, steps):
        if eval due:  sink.log(evaluate(engine, eval split))            # held-out greedy acc, pass@k
        batch      = engine.generate(prompts, sampling)                 # rollout (every rank: the whole batch)
        rewards    = reward_fn(responses, rows, token ids)              # reward.fn
          (grpo.oversample_groups: generate streams groups to reward_fn + grpo.filter and stops
           once prompts_per_step groups pass; recipes/grpo/dynamic_sampling.py)
          (grpo.partial_rollout: the groups it cut off are finished in the next step's call, ahead
           of its fresh prompts; recipes/grpo/partial_rollout.py)
        advantages = group_advantages(shape_rewards(rewards))           # overlong / KL-in-reward shaping
        stats      = grpo_update(trainer, batch, advantages)            # train (ZeRO-2 over the ranks)
        engine.update_weights(weights, version=step + 1)                # the engine samples the new policy
        sink.log(step_metrics(...), step)                               # log (+ reward/mean_ma)
        if step + 1 is a save step: save_checkpoint(...)                # resume=<run dir> continues here

Everything that can be checked is checked before SFT or any rollout: the reward function imports
and answers a probe call, every data row has its keys, the eval split is not empty, a checkpoint to
resume from belongs to this model. ``cfg`` is the composed Hydra config (see ``conf/``), turned into
frozen configs in recipes/grpo/build.py. Outputs (rank 0): metrics.jsonl, timeline.json,
timeline.png, reward.png, samples.jsonl, summary.json, checkpoints/ and the W&B run, all under
``run_dir``. With held-out eval, eval_correct.jsonl keeps each eval's per-prompt 1/0, and the
after-SFT vs after-GRPO paired comparison is printed and kept as summary.json's ``eval/paired``.
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

from splash_rollout.recipes.grpo import checkpoint as ckpt
from splash_rollout.recipes.grpo.dynamic_sampling import GroupScorer, oversample_metrics
from splash_rollout.recipes.grpo.build import (build_engine, build_engine_with_weights, build_policy, eval_config, load_reference,
                                loss_config, lr_schedule, max_prompt_len, model_source, oversample_config,
                                partial_rollout_config, sft_config, tool_env, trainer_config)
from splash_rollout.recipes.grpo.evaluation import evaluate_per_prompt, paired_comparison
from splash_rollout.recipes.grpo.loss import group_advantages
from splash_rollout.recipes.grpo.metrics import memory_metrics, step_metrics
from splash_rollout.recipes.grpo.multi_turn import MultiTurnEngine
from splash_rollout.recipes.grpo.plots import moving_average, plot_reward
from splash_rollout.recipes.grpo.partial_rollout import Carry
from splash_rollout.recipes.grpo.reward_fns import RewardFunction, Rewards
from splash_rollout.recipes.grpo.sft import run_sft
from splash_rollout.recipes.grpo.task_data import Example, PromptOrder, build_task_data
from splash_rollout.recipes.grpo.tool_demos import sft_target
from splash_rollout.recipes.grpo.trainer import Trainer
from splash_rollout.recipes.grpo.update import UpdateConfig, grpo_update, reference_logprobs, shape_rewards
from splash_rollout.models.tokenizer import load_tokenizer
from splash_rollout.reporting import MetricsSink, NoOpSink, make_sink
from splash_rollout.reporting.timeline import TABLE_COLUMNS, plot_timeline, table_rows, write_timeline_json
from splash_rollout.rollout.types import RolloutBatch, SamplingParams

__all__ = ["train", "build_engine", "build_policy", "build_engine_with_weights"]


@contextmanager
def timed(timings: dict[str, float], key: str):
    t0 = time.perf_counter()
    yield
    timings[f"timing_s/{key}"] = time.perf_counter() - t0


def score_batch(reward_fn: RewardFunction, batch: RolloutBatch, examples: list[Example], tokenizer) -> Rewards:
    """The reward function over every sample of the batch, in group order."""
    flat = [(g.prompt_index, s) for g in batch.groups for s in g.samples]
    return reward_fn([tokenizer.decode(s.response_ids) for _, s in flat], [examples[i] for i, _ in flat],
                     [s.response_ids for _, s in flat])


def _setup(cfg: DictConfig, rank: int) -> None:
    hw = cfg.hardware
    if hw.threads:
        torch.set_num_threads(int(hw.threads))
    if hw.flush_denormal:
        torch.set_flush_denormal(True)  # softmax tails go denormal; CPU matmuls slow down ~7x otherwise
    if str(hw.device).startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))  # engine and trainer: this rank's GPU
    torch.manual_seed(cfg.seed)


def _truncate_jsonl(path: str, keep) -> list[dict]:
    """Keep the rows of ``path`` for which ``keep(row)``; returns them (a resumed run drops what
    the interrupted one logged after its last checkpoint)."""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    kept = [r for r in rows if keep(r)]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    return kept


# ---- the loop --------------------------------------------------------------------------------------
def train(cfg: DictConfig, run_dir: str, rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """SFT warm start (or a checkpoint), then GRPO steps up to ``cfg.grpo.steps``. Returns the
    per-step metrics (rank 0)."""
    t_start = time.perf_counter()
    _setup(cfg, rank)
    os.makedirs(run_dir, exist_ok=True)
    g, s = cfg.grpo, cfg.sft
    tokenizer = load_tokenizer(cfg.model.tokenizer or model_source(cfg))
    stop_ids = tuple(tokenizer.eos_token_ids)

    # ---- everything checkable, before any work
    reward_fn = RewardFunction(cfg.reward)
    evaluation = eval_config(cfg)
    sft_cfg = sft_config(cfg)
    resume = cfg.get("resume")
    do_sft = not resume and not s.get("load") and sft_cfg.steps > 0
    oversample = oversample_config(cfg)
    tools = tool_env(cfg, tokenizer)  # tool.*: multi-turn rollouts with a calculator (recipes/grpo/multi_turn.py)
    partial = partial_rollout_config(cfg)
    data = build_task_data(cfg.data, tokenizer, max_prompt_len(cfg), need_eval=evaluation.enabled,
                           sft_examples=sft_cfg.steps * sft_cfg.batch_size if do_sft else 0,
                           fresh_prompts=g.steps * (oversample.oversample_groups if oversample else g.prompts_per_step))
    reward_fn.probe(data.train[0])
    schedule = lr_schedule(cfg)
    losses = loss_config(cfg)
    if losses.kl_coef > 0 and g.get("ref_path") and not os.path.exists(g.ref_path):
        raise FileNotFoundError(f"grpo.ref_path: {g.ref_path!r} does not exist")
    policy = build_policy(cfg)
    fingerprint = ckpt.model_fingerprint(model_source(cfg), policy)
    restored = None
    if resume:
        folder = ckpt.latest_checkpoint(resume)
        state = ckpt.read_state(folder)
        ckpt.check_compatible(state, folder, fingerprint, world_size, schedule.to_dict())
        ckpt.check_carried(state, folder, partial is not None)
        restored = (state, ckpt.load_rank_files(folder, state, rank))
        # before the trainer exists: ZeRO takes its fp32 master copy at deepspeed.initialize
        policy.load_state_dict(restored[1]["policy"], strict=True)
    elif s.get("load"):  # a saved warm start (sft_policy.pt of an earlier run) replaces SFT
        policy.load_state_dict(torch.load(s.load, map_location="cpu"), strict=True)

    sink: MetricsSink = NoOpSink()
    past_rewards: list[float] = []  # reward/mean of the steps so far (rank 0), for reward/mean_ma
    eval_file = os.path.join(run_dir, "eval_correct.jsonl")
    if rank == 0:
        if resume:
            kept = _truncate_jsonl(os.path.join(run_dir, "metrics.jsonl"),
                                   lambda r: r.get("grpo_step", -1) < state.step)
            past_rewards = [r["reward/mean"] for r in kept if "reward/mean" in r]
            _truncate_jsonl(os.path.join(run_dir, "samples.jsonl"), lambda r: r.get("step", -1) < state.step)
            _truncate_jsonl(eval_file, lambda r: r.get("grpo_step", -1) < state.step)
        elif os.path.exists(eval_file):
            os.remove(eval_file)
        sink = make_sink(cfg.logger.kind, rank, run_dir, project=cfg.logger.project, name=cfg.logger.name,
                         mode=cfg.logger.mode, entity=cfg.logger.entity,
                         config=OmegaConf.to_container(cfg, resolve=True))
    trainer = Trainer(policy, trainer_config(cfg), rank=rank, world_size=world_size, temperature=g.temperature)
    sft_summary = {}
    if restored is not None:
        trainer.load_optimizer_state(restored[1]["optimizer"])
    elif do_sft:
        sft_summary = run_sft(trainer, tokenizer, data.sft, sft_cfg, trainer.config.micro_batch_size,
                              log=lambda m, i: log_sft(sink, m, i, rank, cfg.logger.log_sft),
                              targets=(lambda ex: sft_target(ex, tokenizer, tools)) if tools else None,
                              micro_batch_tokens=trainer.config.micro_batch_tokens)
        if rank == 0 and s.get("save", True):
            torch.save(trainer.named_weights(), os.path.join(run_dir, "sft_policy.pt"))
        trainer.reset_optimizer_state()  # GRPO starts with fresh Adam moments, as after sft.load

    ref_model, own_reference = None, False
    if losses.kl_coef > 0:
        if g.get("ref_path"):
            ref_model = load_reference(g.ref_path, trainer.model, cfg.model.dtype)
        else:  # the post-SFT policy (kept in checkpoints, since a resumed run cannot rebuild it)
            ref_model, own_reference = copy.deepcopy(trainer.model).eval().requires_grad_(False), True
            if restored is not None:
                ref_model.load_state_dict(restored[1]["reference"], strict=True)
    update = UpdateConfig(loss=losses, minibatches=g.minibatches, micro_batch_size=trainer.config.micro_batch_size,
                          micro_batch_tokens=trainer.config.micro_batch_tokens,
                          max_new_tokens=g.max_new_tokens, overlong=g.get("overlong", "keep"),
                          overlong_penalty=float(g.get("overlong_penalty", 1.0)), kl_in=g.get("kl_in", "loss"),
                          shuffle_minibatches=bool(g.get("shuffle_minibatches", False)), seed=int(cfg.seed),
                          routing_replay=bool(g.get("routing_replay", False)))

    start, version, cursor, timelines = 0, 0, 0, []
    if restored is not None:
        state, files = restored
        start, version, cursor, timelines = state.step, state.weight_version, state.data_cursor, files["timelines"]
        ckpt.set_rng_states(files["rng"])
    carry = Carry(partial) if partial else None
    if carry is not None and restored is not None:
        carry.load_state_dict(restored[1]["carried"])
    engine = build_engine_with_weights(cfg, trainer.named_weights(), version=version)
    if tools is not None:  # generate (rollouts and eval) now answers calculator calls between turns
        engine = MultiTurnEngine(engine, tools, tools.config.max_turns)
    order = PromptOrder(len(data.train), bool(cfg.data.get("shuffle", False)), int(cfg.data.get("seed", 0)), cursor)
    sampling = SamplingParams(n=g.n, temperature=g.temperature, top_p=g.top_p, max_new_tokens=g.max_new_tokens,
                              stop_token_ids=stop_ids)
    step_offset = sft_cfg.steps if cfg.logger.log_sft else 0
    sleep_during_train = bool(cfg.engine.get("sleep_during_train", False))
    save_every = int(cfg.trainer.get("save_every", 0) or 0)
    samples_file = open(os.path.join(run_dir, "samples.jsonl"), "a") if rank == 0 else None
    ma_window = max(1, int(g.summary_window))  # reward/mean_ma: trailing mean over this many steps

    def run_eval(step: int) -> dict[str, float]:
        if not evaluation.enabled or not (step % evaluation.every == 0 or step == g.steps):
            return {}
        t0 = time.perf_counter()
        out, correct = evaluate_per_prompt(engine, data.eval, reward_fn, tokenizer, evaluation, stop_ids)
        if rank == 0:
            with open(eval_file, "a") as f:  # per prompt, for the paired comparison at the end
                f.write(json.dumps({"grpo_step": step, "correct": correct}) + "\n")
            print(f"[eval] before step {step:3d}: accuracy {out['eval/accuracy']:.3f} "
                  f"[{out['eval/accuracy_low']:.3f}, {out['eval/accuracy_high']:.3f}] on {len(correct)} prompts"
                  + "".join(f" {k[5:]} {v:.3f}" for k, v in out.items() if k.startswith("eval/pass@")), flush=True)
        return {**out, "timing_s/eval": time.perf_counter() - t0}

    for step in range(start, g.steps):
        timings: dict[str, float] = {}
        extra = {**run_eval(step), **(data.metrics() if step == 0 else {})}
        asked = oversample.oversample_groups if oversample else g.prompts_per_step
        # partial rollout: last step's cut-off groups first (too-stale ones dropped), fresh prompts after
        carried = carry.take(engine.weight_version) if carry is not None else []
        indices = [c.data_index for c in carried] + order.take(asked - len(carried))
        examples = [data.train[i] for i in indices]
        fresh = [ex.prompt_ids for ex in examples[len(carried):]]
        trainer.set_lr(schedule.lr_at(step))
        step_sampling = dataclasses.replace(sampling, seed=cfg.seed * 100_003 + step)
        scorer = GroupScorer(reward_fn, examples, tokenizer, oversample.filter) if oversample else None
        with timed(timings, "rollout"):  # with over-sampling this includes scoring the groups
            batch = engine.generate(fresh, step_sampling, on_group=scorer, target_groups=oversample.target_groups,
                                    resume=[c.group for c in carried] or None) if oversample else \
                engine.generate(fresh, step_sampling)
        policy_version = engine.weight_version  # the weights this step trains (and sampled its new tokens)
        partial_stats: dict[str, float] = {}
        if carry is not None:
            carry.put(batch.aborted, indices)
            partial_stats = carry.metrics(batch, policy_version)
        if oversample and not batch.groups:  # every group filtered out: nothing to train on
            metrics = {**oversample_metrics(batch), **partial_stats, **timings, **extra, "grpo_step": float(step)}
            sink.log(metrics, step=step_offset + step)
            if rank == 0:
                print(f"[grpo] step {step:3d}: no group passed grpo.filter={oversample.filter}; no update", flush=True)
            continue
        with timed(timings, "reward"):
            scored = scorer.rewards_of(batch) if oversample else score_batch(reward_fn, batch, examples, tokenizer)
            rewards = torch.tensor(scored.reward, dtype=torch.float32).view(len(batch.groups), g.n)
            ref_lp = None
            if ref_model is not None and update.kl_in == "reward":
                ref_lp = reference_logprobs(ref_model, batch.samples, tokenizer.pad_token_id,
                                            update.micro_batch_size, trainer.temperature, trainer.device,
                                            update.micro_batch_tokens)
            shaped, shape_stats = shape_rewards(rewards, batch, update, ref_lp)
        advantages = group_advantages(shaped, losses.adv_eps, losses.normalize_std)
        memory: dict[str, float] = {}
        if sleep_during_train:
            awake = engine.memory_stats()
            engine.sleep()
            memory = memory_metrics(awake, engine.memory_stats())
        with timed(timings, "train"):
            train_stats = grpo_update(trainer, batch, advantages, update, tokenizer.pad_token_id, step, ref_model,
                                      policy_version=policy_version)
        with timed(timings, "push_weights"):
            if sleep_during_train:
                engine.wake_up()
            engine.update_weights(trainer.named_weights(), version=step + 1)
        timings["timing_s/step"] = sum(timings.values())
        metrics = {**step_metrics(batch, rewards, scored, timings), **shape_stats, **train_stats, **memory, **extra,
                   **(oversample_metrics(batch) if oversample else {}), **partial_stats,
                   "train/lr": schedule.lr_at(step), "grpo_step": float(step)}
        past_rewards.append(metrics["reward/mean"])
        metrics["reward/mean_ma"] = moving_average(past_rewards[-ma_window:], ma_window)[-1]
        sink.log(metrics, step=step_offset + step)
        timelines.append((step, batch.timeline.to_dict()))
        if samples_file is not None:
            write_samples(samples_file, step, batch, examples, rewards, tokenizer, cfg.logger.samples_per_step)
        if rank == 0:
            print(f"[grpo] step {step:3d} reward {metrics['reward/mean']:.3f} acc {metrics['reward/accuracy']:.3f} "
                  f"len {metrics['rollout/response_len/mean']:.1f}/{metrics['rollout/response_len/max']:.0f} "
                  f"tok/s {metrics['perf/tokens_per_s']:.0f} step {timings['timing_s/step']:.1f}s", flush=True)
        if save_every and ((step + 1) % save_every == 0 or step + 1 == g.steps):
            state = ckpt.RunState(step=step + 1, weight_version=step + 1, data_cursor=order.cursor,
                                  lr_schedule=schedule.to_dict(), world_size=world_size, model=fingerprint,
                                  has_reference=own_reference,
                                  carried_groups=len(carry.groups) if carry is not None else 0)
            ckpt.save_checkpoint(run_dir, state, rank, trainer.named_weights(), trainer.optimizer_state(),
                                 ref_model.state_dict() if own_reference else None, timelines,
                                 carried=carry.state_dict() if carry is not None else None)
    final_eval = run_eval(g.steps) if start < g.steps else {}
    paired = paired_eval(eval_file, g.steps) if rank == 0 and final_eval else None
    if final_eval:
        final_eval.update({f"eval/paired/{k}": float(v) for k, v in (paired or {}).items()})
        sink.log({**final_eval, "grpo_step": float(g.steps)}, step=step_offset + g.steps)

    summary: dict[str, Any] = {"sft": sft_summary}
    if rank == 0:
        samples_file.close()
        history = _truncate_jsonl(os.path.join(run_dir, "metrics.jsonl"), lambda r: True)
        write_timeline_json(os.path.join(run_dir, "timeline.json"), timelines)
        png = plot_timeline(os.path.join(run_dir, "timeline.png"), timelines)
        last = step_offset + g.steps - 1
        sink.log_table("timeline/phases", TABLE_COLUMNS, [r for s_, t in timelines for r in table_rows(s_, t)], last)
        sink.log_image("timeline/plot", png, last)
        sink.log_image("reward/plot", plot_reward(os.path.join(run_dir, "reward.png"), history, ma_window, paired),
                       last)
        summary.update(**reward_summary([h for h in history if "reward/mean" in h], cfg.grpo.summary_window),
                       **eval_summary(history), **data.metrics(), total_s=time.perf_counter() - t_start)
        if paired:
            summary["eval/paired"] = paired
        if carry is not None:  # cut off in the last step: never trained (nor dropped)
            summary["rollout/carried_at_end"] = float(len(carry.groups))
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
    engine.shutdown()
    return summary


def log_sft(sink: MetricsSink, metrics: dict[str, float], step: int, rank: int, to_sink: bool) -> None:
    if to_sink:
        sink.log(metrics, step=step)
    if rank == 0:
        print(f"[sft] step {step:4d} loss {metrics['sft/loss']:.3f} lr {metrics['sft/lr']:.2e} "
              f"{metrics['timing_s/sft']:.0f}s", flush=True)


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
