"""Hydra config -> the library's objects: policy, reference, engine and the frozen configs of the run.

The edge where ``cfg`` (composed from ``conf/``) stops: everything past here takes dataclasses.
"""
from __future__ import annotations

import dataclasses
import os

import torch
from omegaconf import DictConfig, OmegaConf

from splash_rollout.recipes.grpo.dynamic_sampling import OversampleConfig
from splash_rollout.recipes.grpo.evaluation import EvalConfig
from splash_rollout.recipes.grpo.loss import GRPOLossConfig
from splash_rollout.recipes.grpo.mtp_training import MTPTrainingConfig
from splash_rollout.recipes.grpo.partial_rollout import PartialRolloutConfig
from splash_rollout.recipes.grpo.process_credit import Supervision
from splash_rollout.recipes.grpo.reward_fns import RewardOptions
from splash_rollout.recipes.grpo.rollout_correction import RolloutCorrectionConfig
from splash_rollout.recipes.grpo.schedule import LRSchedule
from splash_rollout.recipes.grpo.sft import SFTConfig
from splash_rollout.recipes.grpo.task_data import DataOptions
from splash_rollout.recipes.grpo.tool_env import CalculatorEnv, ToolConfig
from splash_rollout.recipes.grpo.trainer import TrainerConfig
from splash_rollout.config_fields import from_mapping
from splash_rollout.models.config import PRESETS, resolve_model
from splash_rollout.models.model import MLAForCausalLM
from splash_rollout.recipes.engine_config import build_engine_or_fleet, engine_config, fleet_replicas, model_source
from splash_rollout.rollout.engine import RolloutEngine

OVERLONG = ("keep", "mask", "penalty")
KL_PLACES = ("loss", "reward")


def build_policy(cfg: DictConfig) -> MLAForCausalLM:
    dtype = getattr(torch, cfg.model.dtype)
    source = model_source(cfg)
    if source in PRESETS:
        model = MLAForCausalLM.from_config(resolve_model(source), seed=cfg.seed, dtype=dtype)
    else:
        model = MLAForCausalLM.from_pretrained(source, dtype=dtype)
    return model.to(cfg.hardware.device)


def load_policy_state(model: torch.nn.Module, state: dict, what: str) -> None:
    """``state`` into ``model``, strictly -- except that a state saved without the model's MTP module
    (``model.mtp_layers.*``: an older run's policy) leaves that module as it is, with a note."""
    from splash_rollout.models.mtp import is_mtp_name

    own = model.state_dict()
    missing = [n for n in own if n not in state]
    if missing and all(is_mtp_name(n) for n in missing):
        print(f"[grpo] {what}: saved without the MTP module; it keeps its initial weights", flush=True)
        state = {**{n: own[n] for n in missing}, **state}
    model.load_state_dict(state, strict=True)


def load_reference(path: str, like: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """A frozen reference policy from ``grpo.ref_path``: a saved state dict (``.pt``, e.g. an
    earlier run's sft_policy.pt) or an HF checkpoint folder of the same architecture."""
    if os.path.isdir(path):
        ref = MLAForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    elif os.path.isfile(path):
        import copy

        ref = copy.deepcopy(like)
        load_policy_state(ref, torch.load(path, map_location="cpu"), "grpo.ref_path")
    else:
        raise FileNotFoundError(f"grpo.ref_path: {path!r} is neither a state-dict file nor a checkpoint folder")
    return ref.to(next(like.parameters()).device).eval().requires_grad_(False)


def build_engine(cfg: DictConfig):
    """The engine the recipe's ``engine`` group describes (``recipes/engine_config.py``); routing
    capture comes from the grpo group (the trainer replays it). With ``engine.fleet.replicas`` > 1:
    a ``Fleet`` of that many such engines, placed by Ray (one trainer process drives it)."""
    return build_engine_or_fleet(cfg, engine_config(cfg, outputs={"return_routing": bool(cfg.grpo.routing_replay)}))


def check_fleet_options(cfg: DictConfig, oversample, partial, tools) -> None:
    """What a fleet does not run yet, refused before any work, naming the option."""
    if fleet_replicas(cfg) == 1:
        return
    for given, name in ((oversample is not None, "grpo.oversample_groups (over-sampling)"),
                        (partial is not None, "grpo.partial_rollout"), (tools is not None, "tool (multi-turn)"),
                        (bool(cfg.engine.sleep_during_train), "engine.sleep_during_train")):
        if given:
            raise ValueError(f"engine.fleet.replicas > 1: {name} runs on one engine only for now; "
                             f"set engine.fleet.replicas=1 or turn it off")


def build_engine_with_weights(cfg: DictConfig, weights: dict[str, torch.Tensor], version: int = 0) -> RolloutEngine:
    """The engine over this run's ranks, holding ``weights`` as ``version``."""
    engine = build_engine(cfg)
    engine.update_weights(weights, version=version)
    return engine


def max_prompt_len(cfg: DictConfig) -> int:
    """``data.max_prompt_len``, or what leaves room for ``grpo.max_new_tokens`` in the context."""
    if cfg.data.max_prompt_len:
        return int(cfg.data.max_prompt_len)
    context = engine_config(cfg).model.context_limit(resolve_model(model_source(cfg)))
    return context - int(max(cfg.grpo.max_new_tokens, cfg.eval.max_new_tokens if cfg.eval.every else 0))


def trainer_config(cfg: DictConfig) -> TrainerConfig:
    t = cfg.trainer
    return TrainerConfig(backend=t.backend, zero_stage=t.zero_stage, lr=t.lr, weight_decay=t.weight_decay,
                         betas=tuple(t.betas), grad_clip=t.grad_clip, micro_batch_size=t.micro_batch_size,
                         micro_batch_tokens=t.micro_batch_tokens, dist_backend=t.dist_backend)


def mtp_training_config(cfg: DictConfig) -> MTPTrainingConfig:
    """``grpo.mtp`` (absent: the defaults): how the model's MTP module trains beside the policy."""
    given = cfg.grpo.get("mtp")
    fields = OmegaConf.to_container(given) if given is not None else {}
    if "betas" in fields:
        fields["betas"] = tuple(fields["betas"])
    return MTPTrainingConfig(**fields)


def sft_config(cfg: DictConfig) -> SFTConfig:
    s = cfg.sft
    return SFTConfig(steps=s.steps, batch_size=s.batch_size, lr=s.lr, warmup_steps=s.warmup_steps,
                     min_lr_ratio=s.min_lr_ratio, log_every=s.log_every)


def loss_config(cfg: DictConfig) -> GRPOLossConfig:
    g = cfg.grpo
    if g.kl_in not in KL_PLACES:
        raise ValueError(f"grpo.kl_in: expected one of {KL_PLACES}, got {g.kl_in!r}")
    if g.overlong not in OVERLONG:
        raise ValueError(f"grpo.overlong: expected one of {OVERLONG}, got {g.overlong!r}")
    return GRPOLossConfig(clip_low=g.clip_low, clip_high=g.clip_high, kl_coef=g.kl_coef,
                          normalize_std=g.normalize_std, loss_agg=g.loss_agg,
                          kl_estimator=g.kl_estimator, entropy_coef=g.entropy_coef,
                          rollout_corr=rollout_correction_config(cfg))


def rollout_correction_config(cfg: DictConfig) -> RolloutCorrectionConfig:
    """``grpo.rollout_corr.*`` (absent: off); an unknown key is an error naming it."""
    given = cfg.grpo.rollout_corr or {}
    given = OmegaConf.to_container(given, resolve=True) if OmegaConf.is_config(given) else dict(given)
    known = set(RolloutCorrectionConfig.__dataclass_fields__)
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"grpo.rollout_corr: unknown option(s) {unknown}; expected some of {sorted(known)}")
    return RolloutCorrectionConfig(**{k: (float(v) if k in ("is_cap", "mask_low", "mask_high") else str(v))
                                      for k, v in given.items()})


def oversample_config(cfg: DictConfig) -> OversampleConfig | None:
    """``grpo.oversample_groups`` (null / 0: off) with ``grpo.filter``."""
    g = cfg.grpo
    asked = g.oversample_groups
    if not asked:
        return None
    return OversampleConfig(oversample_groups=int(asked), target_groups=int(g.prompts_per_step),
                            filter=str(g.filter))


def partial_rollout_config(cfg: DictConfig) -> PartialRolloutConfig | None:
    """``grpo.partial_rollout`` (needs over-sampling: only a streaming call cuts groups off) with
    ``grpo.max_off_policy_steps``."""
    g = cfg.grpo
    on = g.partial_rollout
    if not isinstance(on, bool):
        raise ValueError(f"grpo.partial_rollout: expected true or false, got {on!r}")
    if not on:
        return None
    if not g.oversample_groups:
        raise ValueError("grpo.partial_rollout: needs grpo.oversample_groups (> grpo.prompts_per_step): only an "
                         "over-sampled step cuts groups off to carry on")
    k = g.max_off_policy_steps
    return PartialRolloutConfig(max_off_policy_steps=None if k is None else k)


def lr_schedule(cfg: DictConfig) -> LRSchedule:
    g = cfg.grpo
    return LRSchedule(lr=float(cfg.trainer.lr), kind=g.lr_schedule,
                      warmup_steps=int(g.warmup_steps), total_steps=int(g.steps),
                      min_lr_ratio=float(g.min_lr_ratio))


def data_options(cfg: DictConfig) -> DataOptions:
    """The ``data`` group, typed: an unknown key is refused naming ``data``, a mandatory one left
    unset (``???``) names itself."""
    return from_mapping(DataOptions, OmegaConf.to_container(cfg.data, resolve=True, throw_on_missing=True), "data")


def reward_options(cfg: DictConfig) -> RewardOptions:
    """The ``reward`` group, typed: a misspelt or missing key is refused naming ``reward.<key>``."""
    values = OmegaConf.to_container(cfg.reward, resolve=True)
    missing = sorted({f.name for f in dataclasses.fields(RewardOptions)} - {k for k, v in values.items() if v is not None})
    if missing:
        raise ValueError(f"reward: {', '.join(f'reward.{k}' for k in missing)} not set (conf/reward/chain.yaml "
                         f"lists every key)")
    return from_mapping(RewardOptions, values, "reward")


def eval_config(cfg: DictConfig) -> EvalConfig:
    e = cfg.eval
    k = OmegaConf.to_container(e.k, resolve=True) if OmegaConf.is_list(e.k) else [e.k]
    return EvalConfig(every=int(e.every), max_prompts=e.max_prompts, max_new_tokens=int(e.max_new_tokens),
                      n=int(e.n), k=tuple(int(x) for x in k), temperature=float(e.temperature),
                      seed=int(cfg.seed) * 7_919 + 17)


def tool_env(cfg: DictConfig, tokenizer) -> CalculatorEnv | None:
    """``tool.*`` (absent or ``tool.enabled=false``: single-turn rollouts): the calculator the policy
    may call between turns. Refused with over-sampling (a group's samples finish in different turns)
    and, when SFT writes calculator demonstrations, with data other than the arithmetic chains."""
    t = cfg.get("tool")
    if not t or not t.get("enabled", True):
        return None
    given = {k: v for k, v in OmegaConf.to_container(t, resolve=True).items() if k != "enabled"}
    known = set(ToolConfig.__dataclass_fields__)
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"tool: unknown option(s) {unknown}; expected some of {sorted(known)} or enabled")
    config = ToolConfig(**given)
    if cfg.grpo.oversample_groups:
        raise ValueError("tool: multi-turn rollouts do not combine with grpo.oversample_groups; set it to null")
    if cfg.sft.steps > 0 and config.sft_demo_fraction > 0 and cfg.data.kind != "arith_chain":
        raise ValueError(f"tool.sft_demo_fraction > 0 writes calculator demonstrations of arithmetic chains, "
                         f"but data.kind is {cfg.data.kind!r}; set tool.sft_demo_fraction=0 or data=arith_chain")
    return CalculatorEnv(config, tokenizer)


def supervision_config(cfg: DictConfig, losses: GRPOLossConfig) -> Supervision:
    """``grpo.supervision`` / ``grpo.process_credit``; process supervision refuses the reward shaping it
    would silently drop (an overlong penalty or a KL charged in the reward change the sample's
    reward, not its steps')."""
    g = cfg.grpo
    sup = Supervision(str(g.supervision), str(g.process_credit), losses.adv_eps, losses.normalize_std)
    if sup.kind == "process" and (g.overlong == "penalty" or (g.kl_in == "reward" and losses.kl_coef > 0)):
        raise ValueError("grpo.supervision=process takes its advantages from the steps' rewards, so "
                         "grpo.overlong=penalty and grpo.kl_in=reward (with kl_coef > 0) would not reach them; "
                         "use grpo.overlong=keep|mask and grpo.kl_in=loss")
    return sup
