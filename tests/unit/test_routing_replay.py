"""MoE routing replay (R3): the engine returns each token's routed experts, and a trainer whose
router would choose differently reproduces the engine's logprobs only when it replays them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from splash_rollout.recipes.grpo.loss import token_logprobs
from splash_rollout.recipes.grpo.routing_replay import replay_layers, replay_table
from splash_rollout.recipes.grpo.trainer import collate
from splash_rollout import EngineConfig, RolloutEngine, SamplingParams
from splash_rollout.models.config import PRESETS
from splash_rollout.models.model import MLAForCausalLM
from splash_rollout.models.moe import routing_context

PROMPTS = [[5, 6, 7, 8] * 5, [9, 10, 11], [12] * 30]
NEW = 16
MOE_LAYERS = sum(map(PRESETS["glm5-nano"].is_moe_layer, range(PRESETS["glm5-nano"].num_layers)))
TOP_K = PRESETS["glm5-nano"].num_experts_per_tok


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def rollout(_one_thread):
    cfg = dict(model="glm5-nano", num_pages=128, page_size=8, max_num_batched_tokens=16)  # prefill in chunks
    params = SamplingParams(n=2, max_new_tokens=NEW, seed=7, ignore_eos=True)
    with RolloutEngine(EngineConfig(**cfg, return_routing=True)) as engine:
        batch = engine.generate(PROMPTS, params)
    with RolloutEngine(EngineConfig(**cfg)) as engine:
        plain = engine.generate(PROMPTS, params)
    return batch.samples, plain.samples


def _batch(samples):
    mb = collate([s.prompt_ids for s in samples], [s.response_ids for s in samples], pad_id=0,
                 per_token={"rollout": [s.response_logprobs for s in samples]})
    return mb, *replay_table(samples, mb.input_ids.shape[1])


def _forward(model, mb, replay=None):
    """(logprobs [B, S-1], captured ids per MoE layer [B, S, k])."""
    with torch.no_grad(), routing_context(capture=True, replay=replay) as state:
        lp = token_logprobs(model(mb.input_ids, mb.attention_mask)[:, :-1], mb.targets, 1.0)
    b, s = mb.input_ids.shape
    return lp, [c.view(b, s, -1).sort(-1).values for c in state.captured]


def _perturbed_router_bias(scale: float = 1e-3) -> MLAForCausalLM:
    """glm5-nano (the engine's weights) with the routers' selection bias nudged: the bias only picks
    experts (gating weights are the plain scores), so any logprob change comes from a routing flip."""
    model = MLAForCausalLM.from_config(PRESETS["glm5-nano"], seed=0)
    gen = torch.Generator().manual_seed(1)
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            bias = layer.mlp.gate.e_score_correction_bias
            bias.add_(torch.randn(bias.shape, generator=gen) * scale)
    return model


def test_samples_carry_the_routing_the_model_computes(rollout):
    samples, plain = rollout
    assert all(s.routing is None for s in plain)
    assert [s.response_ids for s in samples] == [s.response_ids for s in plain]  # capturing changes nothing
    for s in samples:
        assert s.routing.dtype == np.int16
        assert s.routing.shape == (len(s.prompt_ids) + NEW - 1, MOE_LAYERS, TOP_K)
    # the same weights in a training forward choose exactly the engine's experts at every position run
    mb, ids, replayed = _batch(samples)
    _, chosen = _forward(MLAForCausalLM.from_config(PRESETS["glm5-nano"], seed=0), mb)
    for j, c in enumerate(chosen):
        assert torch.equal(c[replayed], ids[:, :, j].sort(-1).values[replayed])


def test_replay_reproduces_engine_logprobs_after_a_routing_flip(rollout):
    samples, _ = rollout
    mb, ids, replayed = _batch(samples)
    mask = mb.loss_mask.bool()
    model = _perturbed_router_bias()
    free, chosen = _forward(model, mb)
    flips = sum(int(((c != ids[:, :, j].sort(-1).values).any(-1) & replayed).sum()) for j, c in enumerate(chosen))
    assert flips >= 1
    replay, _ = _forward(model, mb, replay_layers(ids, replayed))
    assert float((replay - mb.extras["rollout"])[mask].abs().max()) <= 1e-5
    assert float((free - mb.extras["rollout"])[mask].abs().max()) > 1e-4


def test_grpo_update_replays_in_the_trainer(rollout):
    import torch.distributed as dist

    from splash_rollout.recipes.grpo.loss import GRPOLossConfig
    from splash_rollout.recipes.grpo.trainer import Trainer, TrainerConfig
    from splash_rollout.recipes.grpo.update import UpdateConfig, grpo_update
    from splash_rollout.rollout.types import RolloutBatch, SampleGroup

    samples, plain = rollout
    was = dist.is_initialized()
    try:
        diffs = {}
        trainer = Trainer(_perturbed_router_bias(), TrainerConfig(backend="torch", lr=1e-4))
        for replay in (False, True):  # zero advantages: zero gradient, the weights stay put
            stats = grpo_update(trainer, RolloutBatch([SampleGroup(0, samples)]), torch.zeros(1, len(samples)),
                                UpdateConfig(GRPOLossConfig(), micro_batch_size=4, routing_replay=replay), pad_id=0,
                                step=0)
            diffs[replay] = stats["train/logprob_diff_max"]
        assert diffs[True] <= 1e-5 < 1e-4 < diffs[False]
        with pytest.raises(ValueError, match="carry no routing; build the engine with"):
            grpo_update(trainer, RolloutBatch([SampleGroup(0, plain)]), torch.zeros(1, len(plain)),
                        UpdateConfig(GRPOLossConfig(), routing_replay=True), pad_id=0, step=1)
    finally:
        if not was and dist.is_initialized():
            dist.destroy_process_group()


def test_replay_checks_its_table():
    model = MLAForCausalLM.from_config(PRESETS["glm5-nano"], seed=0)
    x = torch.tensor([[5, 6, 7]])
    ok = (torch.zeros(3, TOP_K, dtype=torch.int64), torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="routing for 1 MoE layers, the forward calls more routers"):
        with torch.no_grad(), routing_context(replay=[ok]):
            model(x)
    with pytest.raises(ValueError, match=f"routing for {MOE_LAYERS + 1} MoE layers, the forward ran {MOE_LAYERS}"):
        with torch.no_grad(), routing_context(replay=[ok] * (MOE_LAYERS + 1)):
            model(x)
    bad = (torch.full((3, TOP_K), 99, dtype=torch.int64), torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="expert ids outside"):
        with torch.no_grad(), routing_context(replay=[bad] * MOE_LAYERS):
            model(x)
    with pytest.raises(RuntimeError, match="already inside one"):
        with routing_context(capture=True), routing_context(capture=True):
            pass
    with pytest.raises(TypeError, match="return_routing: expected a bool"):
        EngineConfig(model="glm5-nano", return_routing="yes")
