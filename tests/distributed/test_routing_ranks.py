"""Routing capture on 2 spawned ranks (experts spread over the ranks): every layout returns the
routing one rank returns, across a live switch."""
import numpy as np
import torch

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams

PROMPTS = [[5, 6, 7] * 6, [9] * 3]
PARAMS = SamplingParams(n=2, max_new_tokens=8, seed=5, ignore_eos=True)
CFG = dict(model="glm5-nano", num_pages=64, page_size=8, max_num_batched_tokens=16, return_routing=True)


def test_two_ranks_return_one_ranks_routing():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with RolloutEngine(EngineConfig(**CFG)) as engine:
            one = engine.generate(PROMPTS, PARAMS).samples
    finally:
        torch.set_num_threads(threads)
    with RolloutEngine(EngineConfig(**CFG, world_size=2, layout="dp", switch_schedule={3: "tp"})) as engine:
        batch = engine.generate(PROMPTS, PARAMS)
    assert [s["dst"] for s in batch.timeline.switches] == ["tp"]
    for a, b in zip(one, batch.samples):
        assert a.response_ids == b.response_ids
        assert np.array_equal(a.routing, b.routing) and len(a.routing) == len(a.prompt_ids) + 7
