"""Run checkpoints: everything a GRPO run needs to continue as if it had never stopped.

``<run dir>/checkpoints/step_<k>/`` (k = GRPO steps done) holds

* ``policy.pt``: the policy's full weights (rank 0; ZeRO-2 keeps them replicated);
* ``reference.pt``: the frozen KL reference, when the run has one built from its own SFT;
* ``optimizer_rank<r>.pt``: each rank's optimizer state (ZeRO: its partition and fp32 master copy);
* ``rng_rank<r>.pt``: each rank's torch / numpy / python RNG states;
* ``timelines.pt``: rank 0's layout timelines so far (timeline.json is written from them at the end);
* ``carried.pt``: with ``grpo.partial_rollout``, the groups the last step cut off, to be finished by
  the next one (recipes/grpo/partial_rollout.py), with their samples' tokens, logprobs and versions;
* ``state.json`` (written last, by rank 0, once every rank's files are in place): the step, the
  engine's ``weight_version``, the data cursor, the LR schedule, the world size and the model's
  fingerprint. A folder without it is incomplete and never resumed from.

``resume=<run dir>`` takes the newest complete checkpoint there; a checkpoint of another model
(other source or parameter shapes), world size or LR schedule is refused before any work starts, and
so is one that carries partial groups into a run without ``grpo.partial_rollout`` (they would be
lost).
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

STATE = "state.json"


class CheckpointMismatchError(ValueError):
    """The checkpoint was written by a run this one cannot continue (model, world size, schedule)."""


def model_fingerprint(source: str, model: torch.nn.Module) -> dict[str, str]:
    """The model's source name and a digest of its parameter names and shapes."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return {"source": source, "params": h.hexdigest()[:16]}


@dataclass(frozen=True)
class RunState:
    step: int
    """GRPO steps done: the next step to run."""
    weight_version: int
    data_cursor: int
    """Train prompts handed out so far (recipes/grpo/task_data.PromptOrder.cursor)."""
    lr_schedule: dict[str, Any]
    world_size: int
    model: dict[str, str]
    has_reference: bool
    carried_groups: int = 0
    """Partial groups the next step finishes (``carried.pt``); 0 without partial rollout."""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def step_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, "checkpoints", f"step_{step:06d}")


def _atomic_save(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def rng_states() -> dict[str, Any]:
    out = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def save_checkpoint(run_dir: str, state: RunState, rank: int, policy: dict[str, torch.Tensor],
                    optimizer: dict[str, Any], reference: dict[str, torch.Tensor] | None,
                    timelines: list, timeout_s: float = 600.0, carried: list | None = None,
                    mtp: dict[str, Any] | None = None) -> str:
    """Every rank calls this; rank 0 writes ``state.json`` once all ranks' files exist. ``carried``:
    the partial-rollout carry (``Carry.state_dict()``; the same on every rank); ``mtp``: the MTP
    module's optimizer and frozen baseline (``MTPTrainer.state_dict()``; the same on every rank)."""
    folder = step_dir(run_dir, state.step)
    os.makedirs(folder, exist_ok=True)
    _atomic_save(optimizer, os.path.join(folder, f"optimizer_rank{rank}.pt"))
    _atomic_save(rng_states(), os.path.join(folder, f"rng_rank{rank}.pt"))
    if rank != 0:
        return folder
    _atomic_save(policy, os.path.join(folder, "policy.pt"))
    if reference is not None:
        _atomic_save(reference, os.path.join(folder, "reference.pt"))
    _atomic_save(timelines, os.path.join(folder, "timelines.pt"))
    if carried is not None:
        _atomic_save(carried, os.path.join(folder, "carried.pt"))
    if mtp is not None:
        _atomic_save(mtp, os.path.join(folder, "mtp.pt"))
    deadline = time.monotonic() + timeout_s
    for r in range(state.world_size):
        for kind in ("optimizer", "rng"):
            path = os.path.join(folder, f"{kind}_rank{r}.pt")
            while not os.path.isfile(path):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"checkpoint {folder}: rank {r} did not write {os.path.basename(path)} "
                                       f"within {timeout_s:.0f} s")
                time.sleep(0.05)
    tmp = os.path.join(folder, STATE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(state.to_dict(), f, indent=1)
    os.replace(tmp, os.path.join(folder, STATE))
    return folder


def latest_checkpoint(run_dir: str) -> str:
    """The newest complete checkpoint folder under ``run_dir``."""
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"resume: {run_dir!r} is not a directory")
    done = sorted(p for p in glob.glob(os.path.join(run_dir, "checkpoints", "step_*"))
                  if os.path.isfile(os.path.join(p, STATE)))
    if not done:
        raise FileNotFoundError(f"resume: {run_dir!r} has no complete checkpoint (checkpoints/step_*/{STATE}); "
                                f"was it run with trainer.save_every > 0?")
    return done[-1]


def read_state(folder: str) -> RunState:
    with open(os.path.join(folder, STATE)) as f:
        return RunState(**json.load(f))


def check_compatible(state: RunState, folder: str, fingerprint: dict[str, str], world_size: int,
                     lr_schedule: dict[str, Any]) -> None:
    if state.model != fingerprint:
        raise CheckpointMismatchError(f"resume: {folder} holds model {state.model['source']!r} (params "
                                      f"{state.model['params']}); this run builds {fingerprint['source']!r} "
                                      f"(params {fingerprint['params']})")
    if state.world_size != world_size:
        raise CheckpointMismatchError(f"resume: {folder} was written by {state.world_size} ranks; this run has "
                                      f"{world_size} (the optimizer state is partitioned per rank)")
    if state.lr_schedule != lr_schedule:
        raise CheckpointMismatchError(f"resume: {folder} used LR schedule {state.lr_schedule}; this run asks for "
                                      f"{lr_schedule}")


def check_carried(state: RunState, folder: str, partial_rollout: bool) -> None:
    if state.carried_groups and not partial_rollout:
        raise CheckpointMismatchError(f"resume: {folder} carries {state.carried_groups} partial groups for its next "
                                      f"step; resume it with grpo.partial_rollout=true (and the same "
                                      f"grpo.oversample_groups), or they would be lost")


def load_rank_files(folder: str, state: RunState, rank: int) -> dict[str, Any]:
    """policy, optimizer states (all ranks), this rank's RNG states, reference, timelines, carried
    partial groups (every rank reads rank 0's)."""
    load = lambda name: torch.load(os.path.join(folder, name), map_location="cpu", weights_only=False)
    out = {"policy": load("policy.pt"),
           "optimizer": [load(f"optimizer_rank{r}.pt") for r in range(state.world_size)],
           "rng": load(f"rng_rank{rank}.pt"), "timelines": load("timelines.pt")}
    out["reference"] = load("reference.pt") if state.has_reference else None
    out["carried"] = load("carried.pt") if os.path.isfile(os.path.join(folder, "carried.pt")) else []
    out["mtp"] = load("mtp.pt") if os.path.isfile(os.path.join(folder, "mtp.pt")) else None
    return out
