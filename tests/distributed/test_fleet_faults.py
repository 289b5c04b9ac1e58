"""A fleet on a local Ray instance, beyond the happy path: a replica that stops answering (its process
frozen with SIGSTOP, as a hung host looks) is taken out by the health check and its requests finish
elsewhere; with resubmission off, a lost replica's requests end with ReplicaLost and the rest finish;
a replica of two ranks spawns them inside its actor and gives one engine's samples."""
from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from splash_rollout import EngineConfig, SamplingParams
from splash_rollout.fleet import Fleet, FleetOptions, ReplicaLost

CONFIG = EngineConfig(model="glm5-nano")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def spread(fleet, count, new_tokens):
    """``count`` requests, returned once both replicas hold some."""
    requests = [fleet.submit([70 + i, 71, 72] * 4, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, seed=i))
                for i in range(count)]
    deadline = time.monotonic() + 60
    while {r.replica for r in requests} != set(fleet.replicas) and time.monotonic() < deadline:
        time.sleep(0.01)
    return requests


@pytest.mark.filterwarnings("ignore:fleet. replica")
def test_a_replica_that_stops_answering_is_taken_out_and_its_requests_finish_elsewhere(local_ray):
    with Fleet(CONFIG, FleetOptions(replicas=2, health_interval_s=0.5, health_timeout_s=3.0)) as fleet:
        requests = spread(fleet, 6, 64)
        frozen = requests[0].replica
        pid = {row["replica"]: row["pid"] for row in fleet.info()}[frozen]
        os.kill(pid, signal.SIGSTOP)
        try:
            groups = [r.result(120) for r in requests]
        finally:
            try:
                os.kill(pid, signal.SIGCONT)  # if it still exists: let Ray reap it
            except ProcessLookupError:
                pass
        assert all(len(g.samples[0].response_ids) == 64 for g in groups)
        assert [row["replica"] for row in fleet.lost] == [frozen]
        assert "health check" in fleet.lost[0]["why"]
        assert any(r.attempts == 2 and r.replica != frozen for r in requests)  # resubmitted elsewhere


@pytest.mark.filterwarnings("ignore:fleet. replica")
def test_without_resubmission_a_lost_replicas_requests_end_with_replica_lost(local_ray):
    with Fleet(CONFIG, FleetOptions(replicas=2, resubmit=False)) as fleet:
        requests = spread(fleet, 6, 64)
        victim = requests[0].replica
        ray.kill(fleet.replica_actor(victim), no_restart=True)
        lost = ok = 0
        for r in requests:
            try:
                r.result(120)
                ok += 1
            except ReplicaLost as e:
                assert f"replica {victim}" in str(e) and r.replica == victim
                lost += 1
        assert lost >= 1 and ok >= 1 and lost + ok == 6


@pytest.mark.slow
def test_a_replica_of_two_ranks_spawns_them_inside_its_actor(local_ray):
    from splash_rollout import RolloutEngine

    config = EngineConfig(model="glm5-nano", parallel={"world_size": 2, "layout": "auto"}, numerics="reproducible")
    prompts = [[5 + i, 6, 7, 8] * 3 for i in range(4)]
    params = [SamplingParams(n=2, temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=i) for i in range(4)]
    with Fleet(config, FleetOptions(replicas=1)) as fleet:  # one bundle of 2 CPUs: the whole instance
        got = fleet.generate(prompts, params, timeout_s=300)
    with RolloutEngine(config) as engine:
        want = engine.generate(prompts, params)
    assert [s.response_ids for g in got.groups for s in g.samples] == \
        [s.response_ids for g in want.groups for s in g.samples]
    assert {p["replica"] for p in got.timeline.phases} == {0}
