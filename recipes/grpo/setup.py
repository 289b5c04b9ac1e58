"""Everything a GRPO run builds before its first step, in one object (``GRPORun``), so the loop in
``loop.py`` reads as the algorithm.

``set_up`` checks what can be checked before any work (the reward function answers a probe, every
data row has its keys, the eval split is not empty, a checkpoint to resume from belongs to this
model), then builds the data, the policy (SFT, a saved warm start or a checkpoint), the trainer, the
KL reference, the engine holding the policy's weights, where each step's groups come from
(``StepRollout``: plain, over-sampled, partial) and what happens to the engine's memory while the
trainer steps (``EngineMemory``). ``cfg`` is the composed Hydra config (``conf/``).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from typing import IO, Any

import torch
from omegaconf import DictConfig, OmegaConf

from splash_rollout.models.tokenizer import load_tokenizer
from splash_rollout.recipes.grpo import checkpoint as ckpt
from splash_rollout.recipes.grpo.build import (build_engine_with_weights, check_fleet_options, build_policy, eval_config, load_policy_state, load_reference,
                                               loss_config, lr_schedule, max_prompt_len, model_source,
                                               mtp_training_config, oversample_config, partial_rollout_config,
                                               data_options, reward_options, sft_config, supervision_config, tool_env,
                                               trainer_config)
from splash_rollout.recipes.grpo.engine_memory import EngineMemory
from splash_rollout.recipes.grpo.evaluation import EvalConfig, evaluate_per_prompt
from splash_rollout.recipes.grpo.loss import GRPOLossConfig
from splash_rollout.recipes.grpo.process_credit import Supervision
from splash_rollout.recipes.grpo.multi_turn import MultiTurnEngine
from splash_rollout.recipes.grpo.partial_rollout import Carry
from splash_rollout.recipes.grpo.reward_fns import RewardFunction
from splash_rollout.recipes.grpo.sft import SFTConfig, run_sft
from splash_rollout.recipes.grpo.step_rollout import StepRollout
from splash_rollout.recipes.grpo.task_data import DataOptions, PromptOrder, TaskData, build_task_data
from splash_rollout.recipes.grpo.tool_demos import sft_target
from splash_rollout.recipes.grpo.mtp_training import MTPTrainer
from splash_rollout.recipes.grpo.trainer import Trainer
from splash_rollout.recipes.grpo.update import UpdateConfig
from splash_rollout.reporting import MetricsSink, NoOpSink, make_sink
from splash_rollout.rollout.types import SamplingParams


@dataclass
class GRPORun:
    """One rank's run: what ``set_up`` built and the state the loop carries from step to step."""

    cfg: DictConfig
    run_dir: str
    rank: int
    world_size: int
    tokenizer: Any
    reward_fn: RewardFunction
    evaluation: EvalConfig
    data: TaskData
    losses: GRPOLossConfig
    supervision: Supervision
    """Per-sample (outcome) or per-token (process) advantages."""
    schedule: Any
    """The learning-rate schedule (``lr_at(step)``, ``to_dict()``)."""
    trainer: Trainer
    mtp: MTPTrainer
    """The model's MTP module, trained beside the policy (mtp_training.py)."""
    ref_model: torch.nn.Module | None
    own_reference: bool
    """The KL reference is the post-SFT policy (kept in checkpoints) rather than ``grpo.ref_path``."""
    update: UpdateConfig
    engine: Any
    """The RolloutEngine (a MultiTurnEngine around it with tools)."""
    rollout: StepRollout
    engine_memory: EngineMemory
    sampling: SamplingParams
    sink: MetricsSink
    fingerprint: dict
    start: int
    """The first GRPO step to run (a checkpoint's step when resuming)."""
    step_offset: int
    """Added to GRPO steps in the sink (SFT steps come first when they are logged)."""
    sft_summary: dict
    t_start: float
    timelines: list = field(default_factory=list)
    past_rewards: list[float] = field(default_factory=list)
    """reward/mean of the steps so far (rank 0), for reward/mean_ma."""
    samples_file: IO[str] | None = None

    @property
    def steps(self) -> int:
        return int(self.cfg.grpo.steps)

    @property
    def ma_window(self) -> int:
        """reward/mean_ma: the trailing mean over this many steps."""
        return max(1, int(self.cfg.grpo.summary_window))

    @property
    def summary_window(self) -> int:
        """summary.json's first / last reward means: over this many steps."""
        return int(self.cfg.grpo.summary_window)

    @property
    def samples_per_step(self) -> int:
        """Samples written to samples.jsonl per step (``logger.samples_per_step``)."""
        return int(self.cfg.logger.samples_per_step)

    @property
    def eval_file(self) -> str:
        return os.path.join(self.run_dir, "eval_correct.jsonl")

    def sampling_for(self, step: int) -> SamplingParams:
        """The step's sampling: the run's, seeded per step."""
        return dataclasses.replace(self.sampling, seed=self.cfg.seed * 100_003 + step)

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out eval when it is due before ``step`` (and after the last); {} otherwise."""
        ev = self.evaluation
        if not ev.enabled or not (step % ev.every == 0 or step == self.steps):
            return {}
        t0 = time.perf_counter()
        out, correct = evaluate_per_prompt(self.engine, self.data.eval, self.reward_fn, self.tokenizer, ev,
                                           tuple(self.sampling.stop_token_ids))
        if self.rank == 0:
            with open(self.eval_file, "a") as f:  # per prompt, for the paired comparison at the end
                f.write(json.dumps({"grpo_step": step, "correct": correct}) + "\n")
            print(f"[eval] before step {step:3d}: accuracy {out['eval/accuracy']:.3f} "
                  f"[{out['eval/accuracy_low']:.3f}, {out['eval/accuracy_high']:.3f}] on {len(correct)} prompts"
                  + "".join(f" {k[5:]} {v:.3f}" for k, v in out.items() if k.startswith("eval/pass@")), flush=True)
        return {**out, "timing_s/eval": time.perf_counter() - t0}

    def save_if_due(self, step: int) -> None:
        """A checkpoint after ``step`` every ``trainer.save_every`` steps and after the last."""
        save_every = int(self.cfg.trainer.save_every or 0)
        if not save_every or not ((step + 1) % save_every == 0 or step + 1 == self.steps):
            return
        carry = self.rollout.carry
        state = ckpt.RunState(step=step + 1, weight_version=step + 1, data_cursor=self.rollout.order.cursor,
                              lr_schedule=self.schedule.to_dict(), world_size=self.world_size,
                              model=self.fingerprint, has_reference=self.own_reference,
                              carried_groups=len(carry.groups) if carry is not None else 0)
        ckpt.save_checkpoint(self.run_dir, state, self.rank, self.trainer.named_weights(),
                             self.trainer.optimizer_state(),
                             self.ref_model.state_dict() if self.own_reference else None, self.timelines,
                             carried=carry.state_dict() if carry is not None else None,
                             mtp=self.mtp.state_dict() if self.mtp.active else None)


def _configure_process(cfg: DictConfig, rank: int) -> None:
    hw = cfg.hardware
    if hw.threads:
        torch.set_num_threads(int(hw.threads))
    if hw.flush_denormal:
        torch.set_flush_denormal(True)  # softmax tails go denormal; CPU matmuls slow down ~7x otherwise
    if str(hw.device).startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))  # engine and trainer: this rank's GPU
    torch.manual_seed(cfg.seed)


def truncate_jsonl(path: str, keep) -> list[dict]:
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


def log_sft(sink: MetricsSink, metrics: dict[str, float], step: int, rank: int, to_sink: bool) -> None:
    if to_sink:
        sink.log(metrics, step=step)
    if rank == 0:
        print(f"[sft] step {step:4d} loss {metrics['sft/loss']:.3f} lr {metrics['sft/lr']:.2e} "
              f"{metrics['timing_s/sft']:.0f}s", flush=True)


def set_up(cfg: DictConfig, run_dir: str, rank: int, world_size: int) -> GRPORun:
    """Checks, data, policy (SFT / warm start / checkpoint), trainer, reference, engine and the
    step's strategies, in the order the run needs them."""
    t_start = time.perf_counter()
    _configure_process(cfg, rank)
    os.makedirs(run_dir, exist_ok=True)
    checked = check_run(cfg)  # everything checkable, before any work
    policy, fingerprint, restored = initial_policy(cfg, checked, rank, world_size)
    sink, past_rewards = open_outputs(cfg, run_dir, rank, restored)
    trainer, mtp, sft_summary = start_training(cfg, checked, policy, restored, sink, run_dir, rank, world_size)
    ref_model, own_reference = reference_policy(cfg, checked.losses, trainer, restored)
    engine, rollout, start, timelines = start_rollouts(cfg, checked, trainer, restored)
    g = cfg.grpo
    sampling = SamplingParams(n=g.n, temperature=g.temperature, top_p=g.top_p, max_new_tokens=g.max_new_tokens,
                              stop_token_ids=tuple(checked.tokenizer.eos_token_ids))
    return GRPORun(cfg=cfg, run_dir=run_dir, rank=rank, world_size=world_size, tokenizer=checked.tokenizer,
                   reward_fn=checked.reward_fn, evaluation=checked.evaluation, data=checked.data, losses=checked.losses,
                   supervision=checked.supervision, schedule=checked.schedule, trainer=trainer, mtp=mtp,
                   ref_model=ref_model, own_reference=own_reference, update=update_config(cfg, checked.losses, trainer),
                   engine=engine, rollout=rollout, engine_memory=EngineMemory(release=bool(cfg.engine.sleep_during_train)),
                   sampling=sampling, sink=sink, fingerprint=fingerprint, start=start,
                   step_offset=checked.sft.steps if cfg.logger.log_sft else 0, sft_summary=sft_summary,
                   t_start=t_start, timelines=timelines, past_rewards=past_rewards,
                   samples_file=open(os.path.join(run_dir, "samples.jsonl"), "a") if rank == 0 else None)


@dataclass
class Checked:
    """What ``check_run`` read from the config and built before any work: a bad option fails here."""

    tokenizer: Any
    reward_fn: RewardFunction
    evaluation: EvalConfig
    sft: SFTConfig
    do_sft: bool
    """No resume, no ``sft.load``, and SFT steps to run."""
    oversample: Any
    tools: Any
    """The multi-turn calculator environment (``tool.*``), or None."""
    partial: Any
    data_options: DataOptions
    data: Any
    schedule: Any
    losses: GRPOLossConfig
    supervision: Any


def check_run(cfg: DictConfig) -> Checked:
    """Every option the run's parts read, checked and built (the reward probed on a prompt, the data
    made) before any training or rollout."""
    g, s = cfg.grpo, cfg.sft
    tokenizer = load_tokenizer(cfg.model.tokenizer or model_source(cfg))
    reward_fn = RewardFunction(reward_options(cfg))
    evaluation = eval_config(cfg)
    sft_cfg = sft_config(cfg)
    do_sft = not cfg.get("resume") and not s.load and sft_cfg.steps > 0
    oversample = oversample_config(cfg)
    tools = tool_env(cfg, tokenizer)  # tool.*: multi-turn rollouts with a calculator (multi_turn.py)
    partial = partial_rollout_config(cfg)
    check_fleet_options(cfg, oversample, partial, tools)
    mtp_training_config(cfg)
    options = data_options(cfg)
    data = build_task_data(options, tokenizer, max_prompt_len(cfg), need_eval=evaluation.enabled,
                           sft_examples=sft_cfg.steps * sft_cfg.batch_size if do_sft else 0,
                           fresh_prompts=g.steps * (oversample.oversample_groups if oversample else g.prompts_per_step))
    reward_fn.probe(data.train[0])
    losses = loss_config(cfg)
    if losses.kl_coef > 0 and g.ref_path and not os.path.exists(g.ref_path):
        raise FileNotFoundError(f"grpo.ref_path: {g.ref_path!r} does not exist")
    return Checked(tokenizer=tokenizer, reward_fn=reward_fn, evaluation=evaluation, sft=sft_cfg, do_sft=do_sft,
                   oversample=oversample, tools=tools, partial=partial, data_options=options, data=data,
                   schedule=lr_schedule(cfg),
                   losses=losses, supervision=supervision_config(cfg, losses))


def initial_policy(cfg: DictConfig, checked: Checked, rank: int, world_size: int):
    """The policy the run starts from -- the model's init, a checkpoint's (``resume``: checked against
    this run first) or a saved warm start (``sft.load``) -- its fingerprint, and the checkpoint read
    (``(state, files)``) or None."""
    policy = build_policy(cfg)
    fingerprint = ckpt.model_fingerprint(model_source(cfg), policy)
    restored = None
    if cfg.get("resume"):
        folder = ckpt.latest_checkpoint(cfg.resume)
        state = ckpt.read_state(folder)
        ckpt.check_compatible(state, folder, fingerprint, world_size, checked.schedule.to_dict())
        ckpt.check_carried(state, folder, checked.partial is not None)
        restored = (state, ckpt.load_rank_files(folder, state, rank))
        # before the trainer exists: ZeRO takes its fp32 master copy at deepspeed.initialize
        load_policy_state(policy, restored[1]["policy"], "resume")
    elif cfg.sft.load:  # a saved warm start (sft_policy.pt of an earlier run) replaces SFT
        load_policy_state(policy, torch.load(cfg.sft.load, map_location="cpu"), "sft.load")
    return policy, fingerprint, restored


def open_outputs(cfg: DictConfig, run_dir: str, rank: int, restored) -> tuple[MetricsSink, list[float]]:
    """Rank 0's metrics sink and the rewards logged so far; a resumed run drops what the interrupted
    one logged after its checkpoint."""
    sink: MetricsSink = NoOpSink()
    past_rewards: list[float] = []
    if rank != 0:
        return sink, past_rewards
    eval_file = os.path.join(run_dir, "eval_correct.jsonl")
    if restored is not None:
        step = restored[0].step
        kept = truncate_jsonl(os.path.join(run_dir, "metrics.jsonl"), lambda r: r.get("grpo_step", -1) < step)
        past_rewards = [r["reward/mean"] for r in kept if "reward/mean" in r]
        truncate_jsonl(os.path.join(run_dir, "samples.jsonl"), lambda r: r.get("step", -1) < step)
        truncate_jsonl(eval_file, lambda r: r.get("grpo_step", -1) < step)
    elif os.path.exists(eval_file):
        os.remove(eval_file)
    sink = make_sink(cfg.logger.kind, rank, run_dir, project=cfg.logger.project, name=cfg.logger.name,
                     mode=cfg.logger.mode, entity=cfg.logger.entity, config=OmegaConf.to_container(cfg, resolve=True))
    return sink, past_rewards


def start_training(cfg: DictConfig, checked: Checked, policy, restored, sink: MetricsSink, run_dir: str, rank: int,
                   world_size: int) -> tuple[Trainer, MTPTrainer, dict]:
    """The trainer and the MTP module's, then the checkpoint's optimizer state or SFT (unless a warm
    start was loaded); the MTP module GRPO starts from is kept to measure beside the trained one."""
    trainer = Trainer(policy, trainer_config(cfg), rank=rank, world_size=world_size, temperature=cfg.grpo.temperature)
    mtp = MTPTrainer(trainer.model, mtp_training_config(cfg), rank, world_size, trainer.config.micro_batch_size,
                     trainer.config.micro_batch_tokens)
    sft_summary = {}
    if restored is not None:
        trainer.load_optimizer_state(restored[1]["optimizer"])
    elif checked.do_sft:
        tokenizer, tools = checked.tokenizer, checked.tools
        sft_summary = run_sft(trainer, tokenizer, checked.data.sft, checked.sft, trainer.config.micro_batch_size,
                              log=lambda m, i: log_sft(sink, m, i, rank, cfg.logger.log_sft),
                              targets=(lambda ex: sft_target(ex, tokenizer, tools)) if tools else None,
                              micro_batch_tokens=trainer.config.micro_batch_tokens, mtp=mtp)
        if rank == 0 and cfg.sft.save:
            torch.save(trainer.named_weights(), os.path.join(run_dir, "sft_policy.pt"))
        trainer.reset_optimizer_state()  # GRPO starts with fresh Adam moments, as after sft.load
    if restored is not None and restored[1]["mtp"] is not None:
        mtp.load_state_dict(restored[1]["mtp"])
    else:
        mtp.freeze_baseline()  # the module GRPO starts from, measured beside the one that keeps training
    return trainer, mtp, sft_summary


def reference_policy(cfg: DictConfig, losses: GRPOLossConfig, trainer: Trainer, restored):
    """The frozen reference the KL is taken to (``grpo.ref_path``, else the post-SFT policy, kept in
    checkpoints since a resumed run cannot rebuild it) and whether the run owns it; (None, False)
    without a KL term."""
    if losses.kl_coef <= 0:
        return None, False
    if cfg.grpo.ref_path:
        return load_reference(cfg.grpo.ref_path, trainer.model, cfg.model.dtype), False
    ref_model = copy.deepcopy(trainer.model).eval().requires_grad_(False)
    if restored is not None:
        ref_model.load_state_dict(restored[1]["reference"], strict=True)
    return ref_model, True


def update_config(cfg: DictConfig, losses: GRPOLossConfig, trainer: Trainer) -> UpdateConfig:
    g = cfg.grpo
    return UpdateConfig(loss=losses, minibatches=g.minibatches, micro_batch_size=trainer.config.micro_batch_size,
                        micro_batch_tokens=trainer.config.micro_batch_tokens, max_new_tokens=g.max_new_tokens,
                        overlong=g.overlong, overlong_penalty=float(g.overlong_penalty), kl_in=g.kl_in,
                        shuffle_minibatches=bool(g.shuffle_minibatches), seed=int(cfg.seed),
                        routing_replay=bool(g.routing_replay))


def start_rollouts(cfg: DictConfig, checked: Checked, trainer: Trainer, restored):
    """The engine holding the trainer's weights, and where each step's groups come from (the prompt
    order, the partial-rollout carry), resumed where the checkpoint left them. Returns (engine,
    rollout, first step, timelines so far)."""
    start, version, cursor, timelines = 0, 0, 0, []
    if restored is not None:
        state, files = restored
        start, version, cursor, timelines = state.step, state.weight_version, state.data_cursor, files["timelines"]
        ckpt.set_rng_states(files["rng"])
    carry = Carry(checked.partial) if checked.partial else None
    if carry is not None and restored is not None:
        carry.load_state_dict(restored[1]["carried"])
    engine = build_engine_with_weights(cfg, trainer.named_weights(), version=version)
    if checked.tools is not None:  # generate (rollouts and eval) now answers calculator calls between turns
        engine = MultiTurnEngine(engine, checked.tools, checked.tools.config.max_turns)
    data = checked.data
    order = PromptOrder(len(data.train), checked.data_options.shuffle, checked.data_options.seed, cursor)
    rollout = StepRollout(checked.reward_fn, data.train, order, checked.tokenizer, int(cfg.grpo.prompts_per_step),
                          checked.oversample, carry)
    return engine, rollout, start, timelines
