"""The OpenAI-compatible server in front of a fleet: two glm5-nano replicas (T = 1) on a local Ray
instance, driven by the real ``openai`` client over real HTTP (uvicorn in a thread of this process).

One Ray instance, fleet and server for the module; the tests run in file order (the last one kills a
replica). Concurrent seeded completions equal one in-process engine's samples and both replicas
serve; streaming and stop strings (a per-sample abort on the replica) work as on one engine;
/metrics and /timeline name each replica; the admin calls reach every replica; a replica killed
while it streams a completion costs the client nothing -- the text arrives whole, each token once.
And ``python -m splash_rollout.serve engine.fleet.replicas=2`` serves and stops on SIGINT.
"""
from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import ray
import uvicorn

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams
from splash_rollout.fleet import Fleet, FleetOptions
from splash_rollout.serve.app import ServeConfig, make_app
from splash_rollout.serve.backend import ServingBackend
from tests.distributed.test_serve import _free_port, _wait_healthy

CONFIG = EngineConfig(model="glm5-nano", compute={"numerics": "reproducible", "speculation": "off"})
PROMPTS = [[5 + i, 6, 7, 8, 9 + i] * (2 + i % 3) for i in range(8)]


@pytest.fixture(scope="module")
def served():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    fleet = Fleet(CONFIG, FleetOptions(replicas=2, health_interval_s=1.0))
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(make_app(fleet, ServeConfig(port=port, log_level="warning")),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(url)
    yield url, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120), fleet
    server.should_exit = True
    thread.join(30)
    fleet.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def reference():
    with RolloutEngine(CONFIG) as engine:
        yield engine


def test_a_fleet_and_an_engine_are_both_serving_backends(served, reference):
    assert isinstance(served[2], ServingBackend) and isinstance(reference, ServingBackend)


def test_concurrent_completions_over_a_fleet_equal_one_engines_samples(served, reference):
    _, client, fleet = served
    want = reference.generate(PROMPTS, [SamplingParams(n=2, temperature=1.0, max_new_tokens=10, ignore_eos=True,
                                                       seed=50 + i) for i in range(len(PROMPTS))]).groups

    def complete(i):
        r = client.completions.create(model="glm5-nano", prompt=PROMPTS[i], n=2, max_tokens=10, temperature=1.0,
                                      seed=50 + i, logprobs=1, extra_body={"ignore_eos": True, "return_token_ids": True})
        return sorted(r.choices, key=lambda c: c.index)

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(complete, range(len(PROMPTS))))
    for choices, group in zip(got, want):
        for c, s in zip(choices, group.samples, strict=True):
            assert c.token_ids == s.response_ids
            assert max(abs(a - b) for a, b in zip(c.logprobs.token_logprobs, s.response_logprobs)) <= 1e-6
    assert all(row["served"] > 0 for row in fleet.info())  # both replicas took a share


def test_streaming_and_stop_strings_over_a_fleet(served):
    _, client, _ = served
    ask = dict(model="glm5-nano", prompt="3*(4+5)=", max_tokens=24, seed=5, extra_body={"ignore_eos": True})
    whole = client.completions.create(**ask).choices[0].text
    pieces = list(client.completions.create(**ask, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == whole
    assert pieces[-1].choices[0].finish_reason == "length"
    stop = whole[len(whole) // 2:len(whole) // 2 + 2]
    cut = client.completions.create(**ask, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == whole[:whole.index(stop)]  # the replica ended that sample
    chat = client.chat.completions.create(model="glm5-nano", messages=[{"role": "user", "content": "12+7="}],
                                          max_tokens=6, seed=4)
    streamed = list(client.chat.completions.create(model="glm5-nano", messages=[{"role": "user", "content": "12+7="}],
                                                   max_tokens=6, seed=4, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat.choices[0].message.content


def test_one_sample_of_a_fleet_request_aborts_and_the_other_runs_on(served):
    fleet = served[2]
    handle = fleet.submit([33, 34, 35] * 4, SamplingParams(n=2, max_new_tokens=200, ignore_eos=True, seed=3))
    while handle.first_token_at is None:
        time.sleep(0.005)
    handle.abort_sample(0)
    cut, whole = handle.result(120).samples
    assert cut.finish_reason == "abort" and len(cut.response_ids) < 200
    assert whole.finish_reason == "length" and len(whole.response_ids) == 200


def test_metrics_timeline_and_health_name_each_replica(served):
    url, _, _ = served
    metrics = httpx.get(f"{url}/metrics").text
    steps = {m.group(1): float(m.group(2)) for m in re.finditer(r'^splash_steps_total\{replica="(\d+)"\} (\S+)$',
                                                                  metrics, re.M)}
    assert set(steps) == {"0", "1"} and all(v > 0 for v in steps.values()), steps
    assert re.search(r'^splash_kv_pages_total\{rank="0",replica="1"\} \d', metrics, re.M), metrics[:2000]
    phases = httpx.get(f"{url}/timeline").json()["phases"]
    assert {p["replica"] for p in phases} == {0, 1}
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


def test_admin_calls_reach_every_replica(served, reference, tmp_path):
    from splash_rollout.models.config import PRESETS
    from splash_rollout.models.model import MLAForCausalLM
    from splash_rollout.models.weights import save_checkpoint

    url, client, fleet = served
    model = MLAForCausalLM.from_config(PRESETS["glm5-nano"], seed=11)
    save_checkpoint(model, tmp_path)
    r = httpx.post(f"{url}/admin/update_weights", json={"path": str(tmp_path), "version": 3}, timeout=120)
    assert r.status_code == 200 and r.json() == {"version": 3}
    assert {row["weight_version"] for row in fleet.info()} == {3}
    reference.update_weights({k: v.detach() for k, v in model.state_dict().items()}, version=3)
    bad = httpx.post(f"{url}/admin/update_weights", json={"path": str(tmp_path / "nothing")}, timeout=60)
    assert bad.status_code == 400 and {row["weight_version"] for row in fleet.info()} == {3}

    assert httpx.post(f"{url}/admin/sleep", timeout=60).json() == {"asleep": True}
    assert httpx.post(f"{url}/admin/sleep", timeout=60).status_code == 409  # every replica is asleep already
    assert httpx.post(f"{url}/admin/wake_up", timeout=60).json() == {"asleep": False}
    got = client.completions.create(model="glm5-nano", prompt=PROMPTS[0], max_tokens=8, seed=8,
                                    extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0].token_ids
    assert got == reference.generate([PROMPTS[0]], SamplingParams(max_new_tokens=8, ignore_eos=True, seed=8)
                                     ).groups[0].samples[0].response_ids


def test_a_replica_killed_mid_stream_costs_the_client_nothing(served):
    _, client, fleet = served
    ask = dict(model="glm5-nano", prompt=[44, 45, 46, 47] * 3, max_tokens=160, seed=12,
               extra_body={"ignore_eos": True, "return_token_ids": True})
    killed = None
    ids, text = [], ""
    for chunk in client.completions.create(**ask, stream=True):
        ids += chunk.choices[0].token_ids or []
        text += chunk.choices[0].text
        if killed is None and len(ids) >= 8:
            killed = next(row["replica"] for row in fleet.info() if row["in_flight"])
            ray.kill(fleet.replica_actor(killed), no_restart=True)
    assert killed is not None and [row["replica"] for row in fleet.lost] == [killed]
    whole = client.completions.create(**ask).choices[0]  # the same seed on the replica left
    assert ids == whole.token_ids and len(ids) == 160  # each token once: what the lost replica sent is not repeated
    assert text == whole.text


@pytest.mark.slow
def test_python_m_serve_fronts_a_fleet_and_stops_on_sigint():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "splash_rollout.serve", f"serve.port={port}",
                             "engine.parallel.world_size=1", "engine.fleet.replicas=2", "engine.memory.num_pages=64",
                             "serve.drain_timeout_s=2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, 180)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        done = client.completions.create(model="glm5-nano", prompt=[5, 6, 7], max_tokens=4, seed=1,
                                         extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 4
        assert set(re.findall(r'^splash_steps_total\{replica="(\d+)"\}', httpx.get(f"{url}/metrics").text,
                              re.M)) == {"0", "1"}
        proc.send_signal(signal.SIGINT)
        proc.wait(90)
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.stdout.read().decode(errors="replace")
    assert proc.returncode == 0, output[-3000:]
    assert "2 engine(s) of 1 rank(s)" in output, output[-3000:]
