"""Collectives refuse, by name, a tensor on another device than their group's (NCCL groups run on the
rank's GPU, the control group on the CPU); an engine's groups carry its device."""
import pytest
import torch

from splash_rollout.distributed.collectives import CollectiveDeviceError, Comm
from splash_rollout.engine.rank_engine import Engine
from splash_rollout.rollout.build import engine_settings
from splash_rollout.rollout.config import EngineConfig
from splash_rollout.models.config import PRESETS
from splash_rollout.models.model import MLAForCausalLM


@pytest.mark.parametrize("call", [
    lambda c, x: c.all_reduce(x, tag="step/attn"),
    lambda c, x: c.all_gather_uneven(x, [2, 2], tag="step/attn"),
    lambda c, x: c.reduce_scatter_uneven(x, [1, 1], tag="step/mlp"),
    lambda c, x: c.all_to_all_uneven(x, [1, 1], [1, 1], tag="switch/kv"),
])
def test_a_host_tensor_on_a_gpu_group_is_refused_by_name(call):
    comm = Comm(None, 0, 2, device="cuda:1")  # no GPU needed: the check runs before the backend
    with pytest.raises(CollectiveDeviceError, match=r"on the compute group: rank 0's tensor is on cpu, the group's "
                                                    r"collectives run on cuda:1"):
        call(comm, torch.zeros(2, 3))


def test_another_gpu_than_the_groups_is_refused_too():
    comm = Comm(None, 1, 2, device="cuda:0", name="transfer")
    with pytest.raises(CollectiveDeviceError, match="all_reduce .step. on the transfer group: rank 1's tensor is on "
                                                    "meta"):
        comm.all_reduce(torch.zeros(2, device="meta"))


def test_an_engines_groups_carry_its_device():
    cfg = PRESETS["glm5-nano"]
    engine = Engine.single(MLAForCausalLM.from_config(cfg, seed=0), cfg, engine_settings(EngineConfig(model=cfg, memory=dict(num_pages=8), compute=dict(speculation="off"))))
    assert engine.comm.device == engine.transfer.device == engine.device
    assert engine.control.device == torch.device("cpu") and engine.control.name == "control"
