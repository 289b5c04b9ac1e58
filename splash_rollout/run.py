"""Hydra entry: ``python -m splash_rollout.run +recipe=grpo_glm5 [overrides]``.

Composes ``conf/`` (groups: recipe, model, engine, trainer, data, logger, hardware) and runs the
recipe on ``engine.parallel.world_size`` ranks. Under torchrun the launcher's ranks are used as they are;
from a plain process this spawns the ranks itself (gloo on CPU, MASTER_ADDR/PORT set here). Every
rank runs the same loop; only rank 0 writes into the run directory (``hydra.run.dir``, or the
directory given by ``resume=<run dir>``, which the resumed run continues to write into).
"""
from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp

try:
    import hydra
    from omegaconf import DictConfig, OmegaConf
except ModuleNotFoundError as e:  # the engine installs without the recipe's stack
    raise ModuleNotFoundError(f"python -m splash_rollout.run needs the GRPO recipe's stack ({e.name} is not installed): "
                              f"pip install \"splash_rollout[rl]\"", name=e.name) from e

from splash_rollout.conf import CONFIG_DIR as CONF_DIR  # noqa: E402
from splash_rollout.recipes.engine_config import register_engine_fields  # noqa: E402

register_engine_fields()


def compose_config(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The composed config without running Hydra's app machinery (tests, notebooks)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def run_recipe(cfg: DictConfig, run_dir: str, rank: int, world_size: int):
    if "grpo" not in cfg:
        raise ValueError("no recipe selected: add +recipe=grpo_glm5")
    from splash_rollout.recipes.grpo.loop import train

    return train(cfg, run_dir, rank=rank, world_size=world_size)


def _spawned_rank(rank: int, cfg: DictConfig, run_dir: str, world_size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    if not cfg.hardware.threads:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    run_recipe(cfg, run_dir, rank, world_size)


def launch(cfg: DictConfig, run_dir: str):
    """Run on the ranks: torchrun's, or ``engine.parallel.world_size`` spawned ones, or this process alone."""
    from splash_rollout.distributed.groups import under_torchrun
    from splash_rollout.distributed.launch import free_port
    from splash_rollout.recipes.engine_config import fleet_replicas

    if under_torchrun():
        return run_recipe(cfg, run_dir, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    world_size = int(cfg.engine.parallel.world_size)
    if world_size == 1 or fleet_replicas(cfg) > 1:  # a fleet's replicas spawn their own ranks
        return run_recipe(cfg, run_dir, 0, 1)

    mp.spawn(_spawned_rank, args=(cfg, run_dir, world_size, free_port()), nprocs=world_size, join=True)
    return None


@hydra.main(config_path=CONF_DIR, config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    run_dir = cfg.get("resume") or HydraConfig.get().runtime.output_dir
    if int(os.environ.get("RANK", "0")) == 0:
        print(OmegaConf.to_yaml(cfg))
    launch(cfg, run_dir)


if __name__ == "__main__":
    main()
