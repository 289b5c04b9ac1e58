"""sleep() / wake_up() on one rank: the KV pool and the weights' memory really go (tensor bytes and
process RSS drop), nothing runs while asleep, and outputs after waking equal those before."""
import pytest
import torch

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams
from splash_rollout.engine.request import Request, SamplingSpec
from splash_rollout.engine.sleep import TensorOffload, storage_bytes

PROMPTS = [[5, 6, 7] * 10, [9, 10] * 4]
GREEDY = SamplingParams(n=1, temperature=0.0, max_new_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(n=2, temperature=1.0, top_p=0.9, max_new_tokens=8, seed=3, ignore_eos=True)


def outputs(batch):
    return [[(s.response_ids, s.response_logprobs) for s in g.samples] for g in batch.groups]


def test_offload_frees_storages_in_place_and_restores_them_bit_for_bit():
    param = torch.nn.Parameter(torch.randn(64, 32))
    view = param.detach()[8:16]  # an alias: must come back as the same view of the same storage
    other = torch.randn(1000)
    expect = (param.detach().clone(), view.clone(), other.clone())
    offload = TensorOffload([param, view, other])
    assert offload.total_bytes == storage_bytes([param, other]) == (64 * 32 + 1000) * 4
    offload.release()
    assert storage_bytes([param, view, other]) == 0
    offload.restore()
    assert torch.equal(param.detach(), expect[0]) and torch.equal(view, expect[1]) and torch.equal(other, expect[2])
    view.fill_(7.0)  # still a view of the parameter's (new) storage
    assert bool((param.detach()[8:16] == 7.0).all())


def test_sleep_releases_kv_and_weights_and_wake_restores_identical_outputs():
    # reproducible numerics: the calls after wake_up draft from the earlier calls' responses (speculation
    # "auto"), and only there does a verified row round exactly like a decoded one
    config = EngineConfig(model="glm5-nano", memory_budget_gib=0.0625, max_num_batched_tokens=64, page_size=8,
                          numerics="reproducible")
    with RolloutEngine(config) as engine:
        before = [outputs(engine.generate(PROMPTS, p)) for p in (GREEDY, SEEDED)]
        [awake] = engine.memory_stats()
        engine.sleep()
        [asleep] = engine.memory_stats()
        assert engine.is_sleeping
        with pytest.raises(RuntimeError, match="asleep.*wake_up"):
            engine.generate(PROMPTS, GREEDY)
        with pytest.raises(RuntimeError, match="asleep"):
            engine.update_weights({})
        with pytest.raises(RuntimeError, match="already asleep"):
            engine.sleep()
        engine.wake_up()
        [woken] = engine.memory_stats()
        after = [outputs(engine.generate(PROMPTS, p)) for p in (GREEDY, SEEDED)]
        # a second cycle: memory goes again (the re-allocated tensors may sit on the heap now)
        engine.sleep()
        [asleep2] = engine.memory_stats()
        engine.wake_up()
        again = [outputs(engine.generate(PROMPTS, p)) for p in (GREEDY, SEEDED)]
    assert after == before and again == before
    print("memory_stats awake / asleep / woken / asleep again:", awake, asleep, woken, asleep2)
    assert awake["kv_pool"] > 32 * 2**20 and awake["weights"] > 0 and awake["tracked_bytes"] > awake["kv_pool"]
    for sleeping in (asleep, asleep2):
        assert sleeping["kv_pool"] == sleeping["weights"] == sleeping["tracked_bytes"] == 0
        released = awake["kv_pool"] + awake["weights"]
        assert sleeping["rss"] < awake["rss"] - 0.8 * released, (awake, sleeping)
    assert {k: woken[k] for k in ("kv_pool", "weights", "tracked_bytes")} == \
        {k: awake[k] for k in ("kv_pool", "weights", "tracked_bytes")}
    assert woken["rss"] > asleep["rss"] + 0.8 * (awake["kv_pool"] + awake["weights"])


def test_sleep_is_refused_while_requests_are_queued():
    with RolloutEngine(EngineConfig(model="glm5-nano", num_pages=32, page_size=8)) as engine:
        engine.local_engine.scheduler.add(Request(99, [5, 6, 7], SamplingSpec(max_new_tokens=4), 64, (1,)))
        with pytest.raises(RuntimeError, match="queued or running"):
            engine.sleep()
        assert not engine.is_sleeping and engine.memory_stats()[0]["weights"] > 0
        engine.abort()
        engine.local_engine.abort_all()
        engine.sleep()
        engine.wake_up()
        assert outputs(engine.generate(PROMPTS, GREEDY))
