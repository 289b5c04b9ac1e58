"""The trainer: one model replica per rank, data parallel over the same ranks as the engine.

``Trainer`` hides which optimizer engine runs underneath; the loop only calls ``optimizer_step``
(micro-batches + a loss function), ``logprobs`` and ``named_weights``:

* ``backend="deepspeed"`` (default): ``deepspeed.initialize`` with ZeRO stage 2 (optimizer state
  and gradients partitioned over ranks, parameters replicated, so every rank can hand the engine its
  full weights after a step without a gather). gloo on CPU, NCCL on GPU; torch AdamW inside
  (``torch_adam``) so no C++ op has to build.
* ``backend="torch"``: plain ``torch.optim.AdamW`` with gradients averaged by all-reduce, the
  fallback with the same interface.

Micro-batches of one optimizer step accumulate gradients; the loss function is responsible for
normalising by the step's global token count (``grpo_loss(normalizer=...)``), so micro-batch and
rank counts do not change the gradient.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from splash_rollout.recipes.grpo.loss import token_logprobs_and_entropy
from splash_rollout.recipes.grpo.routing_replay import replay_layers
from splash_rollout.models.moe import routing_context
from splash_rollout.models.packed_linear import PACKED
from splash_rollout.distributed.groups import average_gradients, ensure_default_group


@dataclass(frozen=True)
class TrainerConfig:
    backend: str = "deepspeed"
    """deepspeed (ZeRO) or torch (plain AdamW + all-reduce)."""
    zero_stage: int = 2
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    micro_batch_size: int = 64
    """Sequences per forward/backward on one rank."""
    micro_batch_tokens: int | None = None
    """Padded tokens (sequences x the longest) per forward/backward on one rank; None: no token cap
    (``micro_batches.plan_micro_batches``)."""
    dist_backend: str = "auto"
    """auto: nccl when CUDA is available, else gloo."""

    def __post_init__(self) -> None:
        if self.backend not in ("deepspeed", "torch"):
            raise ValueError(f"trainer.backend: expected deepspeed or torch, got {self.backend!r}")
        if self.zero_stage not in (0, 1, 2):
            raise ValueError(f"trainer.zero_stage: expected 0, 1 or 2 (3 shards parameters), got {self.zero_stage}")
        if self.micro_batch_size < 1:
            raise ValueError(f"trainer.micro_batch_size: expected >= 1, got {self.micro_batch_size}")
        t = self.micro_batch_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise ValueError(f"trainer.micro_batch_tokens: expected an integer >= 1 or null, got {t!r}")


def resolve_dist_backend(name: str) -> str:
    return ("nccl" if torch.cuda.is_available() else "gloo") if name == "auto" else name


def ensure_process_group(rank: int, world_size: int, dist_backend: str = "auto") -> None:
    """Join (or reuse) the default process group (see distributed.groups.ensure_default_group)."""
    ensure_default_group(rank, world_size, resolve_dist_backend(dist_backend))


@dataclass
class TrainBatch:
    """Right-padded sequences (prompt + response) of one micro-batch."""

    input_ids: torch.Tensor
    """[B, S] int64"""
    attention_mask: torch.Tensor
    """[B, S] bool, True = real token"""
    loss_mask: torch.Tensor
    """[B, S - 1] float32, 1 where target token t+1 is a trained response token"""
    extras: dict[str, torch.Tensor]
    """Per-target tensors [B, S - 1] (old_logprobs, ref_logprobs, on_policy: 1 where the token was
    sampled by the weights being trained) or per-sample [B] (advantages); with
    routing replay ``routing`` [B, S, moe layers, top_k] int64 and ``routing_replayed`` [B, S] bool
    (recipes/grpo/routing_replay.py), which the forward replays."""

    def to(self, device: torch.device) -> "TrainBatch":
        return TrainBatch(self.input_ids.to(device), self.attention_mask.to(device), self.loss_mask.to(device),
                          {k: v.to(device) for k, v in self.extras.items()})

    @property
    def targets(self) -> torch.Tensor:
        """[B, S - 1] the token each position predicts."""
        return self.input_ids[:, 1:]


def collate(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int,
            response_mask: Sequence[Sequence[int]] | None = None,
            per_token: dict[str, Sequence[Sequence[float]]] | None = None,
            per_sample: dict[str, Sequence[float]] | None = None) -> TrainBatch:
    """Build a TrainBatch; per-token extras are aligned with the response and padded with 0."""
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
    s = max(len(x) for x in seqs)
    b = len(seqs)
    ids = torch.full((b, s), pad_id, dtype=torch.long)
    att = torch.zeros((b, s), dtype=torch.bool)
    mask = torch.zeros((b, s - 1), dtype=torch.float32)
    extras = {k: torch.zeros((b, s - 1), dtype=torch.float32) for k in (per_token or {})}
    for i, (p, r) in enumerate(zip(prompts, responses)):
        n, lp, lr = len(seqs[i]), len(p), len(r)
        ids[i, :n] = torch.tensor(seqs[i], dtype=torch.long)
        att[i, :n] = True
        # target index t predicts token t+1: response token k sits at target index lp - 1 + k
        rm = response_mask[i] if response_mask is not None else [1] * lr
        mask[i, lp - 1:lp - 1 + lr] = torch.tensor(rm, dtype=torch.float32)
        for k, v in (per_token or {}).items():
            extras[k][i, lp - 1:lp - 1 + lr] = torch.tensor(list(v[i]), dtype=torch.float32)
    for k, v in (per_sample or {}).items():
        extras[k] = torch.tensor(list(v), dtype=torch.float32)
    return TrainBatch(ids, att, mask, extras)


LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""(token logprobs [B, S-1] of the current model, batch) -> (loss, stats); with
``optimizer_step(..., entropy=True)`` also the keyword ``entropy`` ([B, S-1] float32)."""


class Trainer:
    def __init__(self, model: nn.Module, config: TrainerConfig, rank: int = 0, world_size: int = 1,
                 temperature: float = 1.0) -> None:
        self.config, self.rank, self.world_size = config, rank, world_size
        self.temperature = temperature
        ensure_process_group(rank, world_size, config.dist_backend)
        from splash_rollout.models.mtp import is_mtp_name

        # the policy's parameters: the MTP modules' are trained apart (mtp_training.py), never by this
        # optimizer, its clipping or its ZeRO master copy
        params = [p for n, p in model.named_parameters() if p.requires_grad and not is_mtp_name(n)]
        self._params = params
        if config.backend == "deepspeed":
            import deepspeed

            # ZeRO-2's gathers call the collective torch renamed in 2.13 (all_gather_into_tensor ->
            # all_gather_single); the FutureWarning it prints on every rank says nothing to a user of the recipe
            warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                                    category=FutureWarning)
            # DeepSpeed reads the local rank from the environment (torchrun sets it); a spawned or
            # lone process sets its own. Only LOCAL_RANK: RANK / WORLD_SIZE would look like torchrun.
            os.environ.setdefault("LOCAL_RANK", str(rank))

            ds_config = {
                "train_micro_batch_size_per_gpu": config.micro_batch_size,
                "gradient_accumulation_steps": 1,  # boundaries are set by hand in optimizer_step
                "gradient_clipping": config.grad_clip,
                "zero_optimization": {"stage": config.zero_stage},
                "optimizer": {"type": "AdamW", "params": {"lr": config.lr, "betas": list(config.betas),
                                                          "weight_decay": config.weight_decay,
                                                          "torch_adam": True}},
                "steps_per_print": 1 << 30,
                "wall_clock_breakdown": False,
            }
            refuse_stale_build_locks()
            self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=params,
                                                                     config=ds_config)
            self.model = self.engine.module
        else:
            self.engine = None
            self.model = model
            self.optimizer = torch.optim.AdamW(params, lr=config.lr, betas=config.betas,
                                               weight_decay=config.weight_decay)
        self.model.train()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def reset_optimizer_state(self) -> None:
        """Forget Adam's moments (e.g. between SFT and RL: SFT's second moments are those of
        cross-entropy gradients, orders of magnitude larger than policy-gradient ones, and would
        shrink the first RL updates to nothing while they decay)."""
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # ZeRO wraps the torch optimizer
        inner.state.clear()

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def optimizer_state(self) -> dict[str, Any]:
        """This rank's optimizer state (ZeRO: its partition, with the fp32 master weights)."""
        return self.optimizer.state_dict()

    def load_optimizer_state(self, states: Sequence[dict[str, Any]]) -> None:
        """Restore ``optimizer_state()`` as saved by every rank (list indexed by rank). Load the
        policy weights into the module before building the Trainer; ZeRO's fp32 master copy is
        restored from the state itself."""
        if len(states) != self.world_size:
            raise ValueError(f"optimizer state: saved by {len(states)} ranks, this run has {self.world_size}")
        if self.engine is not None:
            self.optimizer.load_state_dict(list(states), load_optimizer_states=True, load_from_fp32_weights=True)
        else:
            self.optimizer.load_state_dict(states[self.rank])

    def _forward_logprobs(self, batch: TrainBatch, temperature: float | None = None, entropy: bool = False,
                          mtp: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(token logprobs [B, S-1], entropy or None, with ``mtp`` the first MTP module's logits
        [B, S-1, vocab] read detached from the decoder -- mtp_training.py -- or None)."""
        module = self.engine if self.engine is not None else self.model
        anchor = self._grad_order_anchor() if torch.is_grad_enabled() else None
        kwargs = {"mtp": "detached"} if mtp else {}
        if "routing" in batch.extras:  # the rollout's expert choices (R3)
            with routing_context(replay=replay_layers(batch.extras["routing"], batch.extras["routing_replayed"])):
                out = module(batch.input_ids.to(self.device), batch.attention_mask.to(self.device), **kwargs)
        else:
            out = module(batch.input_ids.to(self.device), batch.attention_mask.to(self.device), **kwargs)
        logits, mtp_logits = (out[0], out[1][0]) if mtp else (out, None)
        temperature = self.temperature if temperature is None else temperature
        logprobs, ent = token_logprobs_and_entropy(logits[:, :-1], batch.targets.to(self.device), temperature,
                                                   entropy=entropy)
        return (logprobs if anchor is None else logprobs + anchor), ent, mtp_logits

    def _grad_order_anchor(self) -> torch.Tensor | None:
        """A zero that depends on every parameter, built *before* the forward.

        ZeRO-2 reduces gradients in buckets filled in the order the parameters' gradients become
        ready, and that order must match on every rank. MoE layers skip experts that got no tokens,
        so without this an expert used on one rank and idle on another gets a gradient (and a bucket
        slot) on one rank only and the reduce-scatter mismatches. The anchor's autograd nodes have
        the smallest sequence numbers, so the backward engine runs them last: every parameter's
        gradient becomes ready at the end of backward, in the anchor's fixed order, on every rank.
        Costs one sum per parameter; only used for DeepSpeed over more than one rank."""
        if self.engine is None or self.world_size == 1:
            return None
        return torch.stack([p.sum() for p in self._params]).sum() * 0.0

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, S-1] token logprobs of the current weights (no grad), same temperature as the engine."""
        return self._forward_logprobs(batch)[0]

    def optimizer_step(self, micro_batches: Sequence[TrainBatch], loss_fn: LossFn,
                       temperature: float | None = None, entropy: bool = False, mtp=None) -> dict[str, float]:
        """Accumulate gradients over ``micro_batches`` (this rank's share), then one optimizer step.
        ``temperature``: of the logprobs handed to ``loss_fn`` (default: the rollout's; SFT uses 1).
        ``entropy``: also hand ``loss_fn`` the per-token entropy (keyword ``entropy``). ``mtp``: an
        ``MTPTrainer`` whose module's loss rides on the same forward and backward (its gradient
        reaches the module alone) and which steps after the policy (mtp_training.py).
        Returns summed loss, grad norm and the mean of ``loss_fn``'s stats over micro-batches
        (``*_max`` stats: the max), and ``mtp/loss``."""
        totals: dict[str, float] = {}
        loss_sum = 0.0
        mtp = mtp if mtp is not None and mtp.active else None
        mtp_tokens = max(sum(mtp.drafted_tokens(mb) for mb in micro_batches), 1) if mtp is not None else 1
        mtp_sums = torch.zeros(2, dtype=torch.float64)
        for i, mb in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            if self.engine is not None:
                self.engine.set_gradient_accumulation_boundary(last)
            mb = mb.to(self.device)
            logprobs, ent, mtp_logits = self._forward_logprobs(mb, temperature, entropy, mtp=mtp is not None)
            loss, stats = loss_fn(logprobs, mb, entropy=ent) if entropy else loss_fn(logprobs, mb)
            loss_sum += float(loss.detach())
            if mtp is not None:
                mtp_loss, sums = mtp.loss(mtp_logits, mb, mtp_tokens)
                mtp_sums += sums
                loss = loss + mtp_loss  # its gradient reaches the MTP module alone (read detached)
            if self.engine is not None:
                self.engine.backward(loss)
            else:
                loss.backward()
            for k, v in stats.items():
                if k.endswith("_max"):
                    totals[k] = max(totals.get(k, float("-inf")), float(v))
                else:
                    totals[k] = totals.get(k, 0.0) + float(v) / len(micro_batches)
        grad_norm = self._step()
        mtp_stats = mtp.step(mtp_sums) if mtp is not None else {}
        # the weights changed in place -- ZeRO copies its fp32 masters back through ``.data``, which
        # leaves no version -- so the oneDNN-packed copies a no-grad forward reads are of the old values
        PACKED.clear()
        return {"loss": loss_sum, "grad_norm": grad_norm, **totals, **mtp_stats}

    def _step(self) -> float:
        if self.engine is not None:
            self.engine.step()
            norm = self.engine.get_global_grad_norm()
            return float(norm) if norm is not None else float("nan")
        params = [p for p in self._params if p.grad is not None]
        if self.world_size > 1:
            # every rank reduces every trainable parameter, in one order: an MoE expert that got no
            # token on this rank has no gradient here but may have one on another rank, and the
            # replicas must take the same step (a zero gradient stands in for the missing one)
            params = list(self._params)
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            average_gradients(params)
        norm = torch.nn.utils.clip_grad_norm_(params, self.config.grad_clip) if self.config.grad_clip > 0 \
            else torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The full weights under the model's own parameter names (what ``update_weights`` takes).
        ZeRO-2 keeps parameters replicated, so this is local on every rank."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def describe(self) -> dict[str, Any]:
        return {"backend": self.config.backend, "world_size": self.world_size, **asdict(self.config)}


STALE_BUILD_LOCK_S = 600.0
"""A JIT-build lock older than this is left over from a killed build (a build here takes about a minute)."""


def refuse_stale_build_locks(root: str | None = None, max_age_s: float = STALE_BUILD_LOCK_S) -> None:
    """DeepSpeed builds its CPU ops with torch's JIT extension loader, which waits without a time limit
    on a ``lock`` file in the build folder; a build killed midway leaves it and every later run hangs
    inside ``deepspeed.initialize``. Refuse, naming the file, when an old one is there."""
    import glob
    import time

    if root is None:  # torch's JIT build folder (torch.utils.cpp_extension)
        root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
            os.path.expanduser("~"), ".cache", "torch_extensions")
    now = time.time()
    for lock in glob.glob(os.path.join(root, "**", "lock"), recursive=True):
        try:
            age = now - os.path.getmtime(lock)
        except OSError:  # removed meanwhile: a build finished
            continue
        if age > max_age_s:
            raise RuntimeError(f"trainer: {lock} is {age / 60:.0f} minutes old -- left by a DeepSpeed op build "
                               f"that was killed; torch would wait on it forever. Remove it (no build is running "
                               f"if this is the only job) and start again")

