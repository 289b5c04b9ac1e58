"""A fleet of two glm5-nano replicas (T = 1) on a local Ray instance of this machine's 2 CPUs.

One Ray instance and one fleet for the module (starting them costs ~15 s); the tests run in file
order and the reference engine (in this process) follows the fleet's weight pushes, so every
comparison is against one engine with the same weights and seeds.
"""
from __future__ import annotations

import time

import pytest
import ray

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams
from splash_rollout.fleet import Fleet, FleetOptions
from splash_rollout.models.config import PRESETS
from splash_rollout.models.model import MLAForCausalLM

CONFIG = EngineConfig(model="glm5-nano", numerics="reproducible")


@pytest.fixture(scope="module")
def fleet():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    f = Fleet(CONFIG, FleetOptions(replicas=2, health_interval_s=1.0))
    yield f
    f.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def reference():
    with RolloutEngine(CONFIG) as engine:
        yield engine


def same_samples(got, want):
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g.samples, w.samples, strict=True):
            assert a.response_ids == b.response_ids
            assert max((abs(x - y) for x, y in zip(a.response_logprobs, b.response_logprobs)), default=0) <= 1e-6


def test_two_replicas_give_one_engines_samples(fleet, reference):
    prompts = [[5 + i, 6, 7, 8] * (2 + i) for i in range(6)]
    params = [SamplingParams(n=2, temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=100 + i) for i in range(6)]
    batch = fleet.generate(prompts, params, timeout_s=300)
    same_samples(batch.groups, reference.generate(prompts, params).groups)
    assert [g.prompt_index for g in batch.groups] == list(range(6))
    assert all(row["served"] > 0 for row in fleet.info())  # both replicas took a share
    assert {p["replica"] for p in batch.timeline.phases} == {0, 1}  # each replica's phases of this call
    assert sum(p["steps"] for p in batch.timeline.phases) > 0
    assert batch.metrics["fleet/replica_0/groups"] + batch.metrics["fleet/replica_1/groups"] == 6


def test_a_bad_request_gets_the_engines_error_and_the_fleet_serves_on(fleet):
    with pytest.raises(ValueError, match=r"prompts\[0\].*vocab"):
        fleet.submit([5, 10**6], SamplingParams(max_new_tokens=4, seed=1)).result(120)
    with pytest.raises(ValueError, match="prompt: expected a string or a non-empty list"):
        fleet.submit([], SamplingParams(max_new_tokens=4, seed=1))
    assert fleet.submit([5, 6], SamplingParams(max_new_tokens=4, seed=1)).result(120).samples[0].response_ids
    assert set(fleet.placement.load.values()) == {0}  # nothing left counted in flight


def test_a_prompt_that_extends_an_earlier_one_goes_where_its_prefix_is_cached(fleet):
    history = [11, 12, 13, 14, 15, 16, 17, 18] * 12  # 96 tokens: one full placement block and more
    first = fleet.submit(history, SamplingParams(max_new_tokens=8, ignore_eos=True, seed=1))
    turn = first.result(300)
    before = {row["replica"]: row["cached_tokens"] for row in fleet.info()}
    second = fleet.submit(history + turn.samples[0].response_ids + [20, 21, 22],
                          SamplingParams(max_new_tokens=8, ignore_eos=True, seed=2))
    second.result(300)
    after = {row["replica"]: row["cached_tokens"] for row in fleet.info()}
    assert second.replica == first.replica
    assert after[first.replica] - before[first.replica] >= 64  # the history came from that replica's cache


def test_one_weight_push_reaches_every_replica(fleet, reference):
    named = {k: v.detach() for k, v in MLAForCausalLM.from_config(PRESETS["glm5-nano"], seed=11).state_dict().items()}
    prompts = [[30 + i, 31, 32] * 3 for i in range(4)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=7 + i) for i in range(4)]
    old = fleet.generate(prompts, params, timeout_s=300).groups
    name = "model.layers.1.self_attn.o_proj.weight"
    with pytest.raises(ValueError, match=rf"{name}: expected shape"):  # refused by all, changes none
        fleet.update_weights({**named, name: named[name].t()}, version=4, bucket_bytes=1 << 16)
    assert fleet.weight_version == 0 and {row["weight_version"] for row in fleet.info()} == {0}
    same_samples(fleet.generate(prompts, params, timeout_s=300).groups, old)
    assert fleet.update_weights(named, version=5, bucket_bytes=1 << 16) == 5  # many buckets
    reference.update_weights(named, version=5)
    requests = [fleet.submit(p, s) for p, s in zip(prompts, params)]
    new = [r.result(300) for r in requests]
    assert {r.replica for r in requests} == set(fleet.replicas)  # both replicas served the new weights
    same_samples(new, reference.generate(prompts, params).groups)
    assert [s.response_ids for g in new for s in g.samples] != [s.response_ids for g in old for s in g.samples]
    assert all(set(s.token_versions) == {5} for g in new for s in g.samples)
    assert {row["weight_version"] for row in fleet.info()} == {5}


def test_a_killed_replica_loses_no_request_and_a_new_one_joins(fleet, reference):
    prompts = [[40 + i, 41, 42, 43] * 4 for i in range(8)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=48, ignore_eos=True, seed=50 + i) for i in range(8)]
    requests = [fleet.submit(p, s) for p, s in zip(prompts, params)]
    deadline = time.monotonic() + 120
    while {r.replica for r in requests} != set(fleet.replicas) and time.monotonic() < deadline:
        time.sleep(0.01)
    victim = requests[0].replica
    on_victim = [r for r in requests if r.replica == victim]
    ray.kill(fleet.replica_actor(victim), no_restart=True)
    groups = [r.result(300) for r in requests]  # every request ends, each once
    same_samples(groups, reference.generate(prompts, params).groups)
    assert [row["replica"] for row in fleet.lost] == [victim] and victim not in fleet.replicas
    for r in on_victim:  # finished there before the kill, or sent once more, elsewhere
        assert (r.attempts, r.replica == victim) in ((1, True), (2, False))
    assert any(r.attempts == 2 for r in on_victim)  # at least one was resubmitted

    joined = fleet.add_replica()
    assert {row["replica"]: row["weight_version"] for row in fleet.info()}[joined] == fleet.weight_version  # last push
    more = [fleet.submit([60 + i, 61, 62] * 3, SamplingParams(max_new_tokens=6, ignore_eos=True, seed=i))
            for i in range(4)]
    got = [r.result(300) for r in more]
    assert joined in {r.replica for r in more}
    same_samples(got, reference.generate([[60 + i, 61, 62] * 3 for i in range(4)],
                                         [SamplingParams(max_new_tokens=6, ignore_eos=True, seed=i)
                                          for i in range(4)]).groups)
