"""Process groups, made in one place and passed to every collective: compute, switch transfer, CPU control.

* ``compute``: the step's own collectives (all-reduce after o_proj, DOP's all-to-alls, CP's merge).
* ``transfer``: switch transfers (weights and KV of layer i while layer i-1 computes), a separate
  communicator so its collectives never interleave with the step's.
* ``control``: a gloo group on CPU for the driver's step plans and small objects.

On CPU all three are gloo; on GPU compute and transfer are NCCL. Every collective gets a timeout
at group creation, so a dead peer turns into an error, never a hang.

Ranks on one host also get shared-memory channels for the step's CPU collectives (``compute`` on
gloo, and ``control``): about a thousandth of gloo's latency for the small messages a step sends
(``distributed/shm_channel.py``). ``SPLASH_ROLLOUT_SHM=0`` in the environment turns them off.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ProcessGroups:
    """The groups of one worker group of T ranks."""

    rank: int
    world_size: int
    backend: str
    """``gloo`` or ``nccl`` for compute and transfer."""
    compute: object
    transfer: object
    control: object
    timeout_s: float
    compute_channel: object = None
    """A ``ShmChannel`` beside ``compute`` when it is gloo and every rank is on one host, else None."""
    control_channel: object = None
    """A ``ShmChannel`` beside ``control`` when every rank is on one host, else None."""

    @classmethod
    def single(cls, timeout_s: float = DEFAULT_TIMEOUT_S) -> "ProcessGroups":
        """One rank in this process, no torch.distributed: every collective is a no-op."""
        return cls(0, 1, "none", None, None, None, timeout_s)

    @property
    def device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def init_process_groups(rank: int, world_size: int, master_addr: str, master_port: int,
                        backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S) -> ProcessGroups:
    """Join the default group over TCP and create the three groups (collective on all ranks)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                                world_size=world_size, timeout=timeout)
    ranks = list(range(world_size))
    compute = dist.new_group(ranks, backend=backend, timeout=timeout)
    transfer = dist.new_group(ranks, backend=backend, timeout=timeout)
    control = dist.new_group(ranks, backend="gloo", timeout=timeout)
    return ProcessGroups(rank, world_size, backend, compute, transfer, control, timeout_s,
                         *_channels(control, rank, world_size, backend, timeout_s))


def shm_enabled() -> bool:
    return os.environ.get("SPLASH_ROLLOUT_SHM", "1").strip().lower() not in ("0", "false", "no", "off")


def _channels(control, rank: int, world_size: int, backend: str, timeout_s: float) -> tuple[object, object]:
    """(compute channel, control channel), opened collectively over the gloo ``control`` group."""
    if world_size == 1 or not shm_enabled():
        return None, None
    from splash_rollout.distributed.shm_channel import open_channel

    control_channel = open_channel(control, rank, world_size, timeout_s)
    compute_channel = open_channel(control, rank, world_size, timeout_s) if backend == "gloo" else None
    return compute_channel, control_channel


def init_from_torchrun(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> ProcessGroups:
    """Under torchrun (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set): the trainer's ranks."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"torchrun environment: missing {', '.join(missing)}; launch with torchrun")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    bind_local_gpu(backend)
    return init_process_groups(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ["MASTER_ADDR"],
                               int(os.environ["MASTER_PORT"]), backend, timeout_s)


def bind_local_gpu(backend: str) -> None:
    """Under NCCL, make this process's GPU (``LOCAL_RANK``: torchrun's index of the rank on its host)
    the current CUDA device before any collective, so NCCL and every kernel use it. Nothing to do on
    gloo, or without ``LOCAL_RANK`` (the caller bound its device itself)."""
    if backend == "nccl" and "LOCAL_RANK" in os.environ and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())


def initialized_world_size() -> int | None:
    """Ranks of the already initialised default group, or None when there is none."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else None


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                   and "LOCAL_RANK" in os.environ)


def destroy_process_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def groups_in_process(timeout_s: float = DEFAULT_TIMEOUT_S) -> ProcessGroups:
    """The three groups over an already initialised default group (torchrun, or a trainer that
    called init_process_group): the engine then lives in the caller's ranks. Collective."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; launch with torchrun or let the engine spawn")
    timeout = datetime.timedelta(seconds=timeout_s)
    world, rank = dist.get_world_size(), dist.get_rank()
    backend = dist.get_backend()
    bind_local_gpu(str(backend))
    ranks = list(range(world))
    compute = dist.new_group(ranks, backend=backend, timeout=timeout)
    transfer = dist.new_group(ranks, backend=backend, timeout=timeout)
    control = dist.new_group(ranks, backend="gloo", timeout=timeout)
    return ProcessGroups(rank, world, str(backend), compute, transfer, control, timeout_s,
                         *_channels(control, rank, world, str(backend), timeout_s))


def ensure_default_group(rank: int, world_size: int, backend: str = "auto",
                         timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join (or reuse) the default process group for a trainer. The rendezvous comes from
    MASTER_ADDR / MASTER_PORT (torchrun, a spawning launcher); a lone process takes a free local port.
    The environment is left untouched."""
    if dist.is_initialized():
        return
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        init_method = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    else:
        if world_size != 1:
            raise RuntimeError(f"world_size {world_size}: set MASTER_ADDR / MASTER_PORT (torchrun does)")
        from splash_rollout.distributed.launch import free_port

        init_method = f"tcp://127.0.0.1:{free_port()}"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def average_gradients(params) -> None:
    """Mean of each parameter's gradient over the default group (plain data parallelism), in one
    collective over the gradients laid end to end (one per tensor costs a round trip each)."""
    grads = [p.grad for p in params]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def sum_over_ranks(values: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """``values`` summed over the default group (computed on ``device``: the backend's), on the CPU."""
    out = values.to(device)
    dist.all_reduce(out)
    return out.cpu()
