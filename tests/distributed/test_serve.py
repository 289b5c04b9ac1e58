"""The OpenAI-compatible server on two CPU ranks, driven by the real ``openai`` client over real HTTP.

One server (uvicorn in a thread of the test process, the engine's two ranks spawned) serves every
test of the module: concurrent seeded completions equal the in-process engine's samples, a short
request finishes while a long one runs, bad requests get their 4xx and nothing running is lost,
chat and streaming work, a weight push lands at a step boundary with each token's version; and a
``python -m splash_rollout.serve`` process that gets SIGINT leaves no rank behind.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams
from splash_rollout.serve.app import ServeConfig, make_app

ENGINE = dict(model="glm5-nano", memory={"num_pages": 512, "page_size": 16},
              compute={"numerics": "reproducible", "speculation": "off"})
PROMPTS = [[5 + i, 6, 7, 8, 9 + i] * (2 + i % 3) for i in range(8)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url}: not healthy within {timeout_s} s")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    engine = RolloutEngine(EngineConfig(parallel={"world_size": 2, "layout": "dp"}, **ENGINE))
    port = _free_port()
    app = make_app(engine, ServeConfig(port=port, log_level="warning"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(url)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    yield url, client, engine
    server.should_exit = True
    thread.join(30)
    engine.shutdown()


@pytest.fixture(scope="module")
def reference():
    with RolloutEngine(EngineConfig(**ENGINE)) as engine:  # one rank in this process
        batch = engine.generate(PROMPTS, [SamplingParams(n=2, temperature=1.0, max_new_tokens=10, ignore_eos=True,
                                                          seed=50 + i) for i in range(len(PROMPTS))])
    return [[(s.response_ids, s.response_logprobs) for s in g.samples] for g in batch.groups]


def test_concurrent_seeded_completions_equal_the_in_process_engine(served, reference):
    _, client, _ = served

    def complete(i):
        r = client.completions.create(model="glm5-nano", prompt=PROMPTS[i], n=2, max_tokens=10, temperature=1.0,
                                      seed=50 + i, logprobs=1, extra_body={"ignore_eos": True, "return_token_ids": True})
        return [(c.token_ids, c.logprobs.token_logprobs) for c in sorted(r.choices, key=lambda c: c.index)], r

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(complete, range(len(PROMPTS))))
    for i, (got, response) in enumerate(results):
        assert [ids for ids, _ in got] == [ids for ids, _ in reference[i]], i
        assert all(abs(a - b) <= 1e-6 for (_, x), (_, y) in zip(got, reference[i]) for a, b in zip(x, y))
        assert response.prompt_token_ids == PROMPTS[i] and response.usage.completion_tokens == 20


def test_a_short_request_sent_while_a_long_one_runs_finishes_first(served):
    _, client, _ = served
    order = []

    def complete(name, tokens):
        client.completions.create(model="glm5-nano", prompt=[5, 6, 7], max_tokens=tokens, seed=1,
                                  extra_body={"ignore_eos": True})
        order.append(name)

    long = threading.Thread(target=complete, args=("long", 300))
    long.start()
    time.sleep(1.0)
    complete("short", 2)
    long.join(120)
    assert order == ["short", "long"]


@pytest.mark.parametrize("body,status,field", [
    ({"model": "glm5-nano", "prompt": [5, 99999], "max_tokens": 2}, 400, "vocab"),
    ({"model": "glm5-nano", "prompt": [5] * 5000, "max_tokens": 2}, 400, "max_model_len"),
    ({"model": "glm5-nano", "prompt": [5, 6], "max_tokens": -3}, 400, "max_tokens"),
    ({"model": "glm5-nano", "prompt": [5, 6], "n": 0}, 400, "n: expected an integer >= 1"),
    ({"model": "gpt-4", "prompt": [5, 6]}, 404, "not served here"),
    ({"model": "glm5-nano", "prompt": [5, 6], "temperature": "hot"}, 400, "temperature"),
])
def test_bad_requests_get_their_4xx_and_name_the_field(served, body, status, field):
    url, client, engine = served
    running = engine.submit([5, 6, 7, 8], SamplingParams(max_new_tokens=40, ignore_eos=True, seed=9))
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert field in r.json()["error"]["message"]
    ok = client.completions.create(model="glm5-nano", prompt=[5, 6, 7], max_tokens=3, seed=3)
    assert ok.usage.completion_tokens == 3
    assert len(running.result(120).samples[0].response_ids) == 40  # what ran beside it is not lost


def test_malformed_json_is_a_400(served):
    url, _, _ = served
    r = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]


def test_chat_and_streaming(served):
    _, client, _ = served
    chat = client.chat.completions.create(model="glm5-nano", messages=[{"role": "user", "content": "12+7="}],
                                          max_tokens=6, seed=4)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    whole = client.completions.create(model="glm5-nano", prompt="3*(4+5)=", max_tokens=8, seed=5,
                                      extra_body={"ignore_eos": True})
    pieces = list(client.completions.create(model="glm5-nano", prompt="3*(4+5)=", max_tokens=8, seed=5, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(p.choices[0].text for p in pieces) == whole.choices[0].text
    assert pieces[-1].choices[0].finish_reason == "length"
    streamed_chat = list(client.chat.completions.create(
        model="glm5-nano", messages=[{"role": "user", "content": "12+7="}], max_tokens=6, seed=4, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed_chat) == chat.choices[0].message.content


def test_models_health_metrics_timeline(served):
    url, client, _ = served
    assert [m.id for m in client.models.list().data] == ["glm5-nano"]
    client.completions.create(model="glm5-nano", prompt=[3, 4, 5], max_tokens=3, extra_body={"ignore_eos": True})
    metrics = httpx.get(f"{url}/metrics").text
    for name in ("splash_requests_running", "splash_kv_pages_used", "splash_layout", "splash_tokens_per_second",
                 "splash_generated_tokens_total", "splash_prefix_cache_hit_tokens_total"):
        assert name in metrics, name
    value = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(splash_\w+(?:_count|_sum))\s+(\S+)$", metrics, re.M)}
    for name in ("splash_time_to_first_token_seconds", "splash_e2e_request_latency_seconds"):
        assert value[f"{name}_count"] >= 1 and value[f"{name}_sum"] > 0, name  # the completion above, at least
    assert "phases" in httpx.get(f"{url}/timeline").json()


def test_a_weight_push_lands_at_a_step_boundary_with_versions(served, tmp_path):
    from splash_rollout.models.config import PRESETS
    from splash_rollout.models.model import MLAForCausalLM
    from splash_rollout.models.weights import save_checkpoint

    url, _, engine = served
    save_checkpoint(MLAForCausalLM.from_config(PRESETS["glm5-nano"], seed=11), tmp_path)
    handle = engine.submit([5, 6, 7, 8], SamplingParams(max_new_tokens=120, ignore_eos=True, seed=6))
    while handle.first_token_at is None:
        time.sleep(0.01)
    r = httpx.post(f"{url}/admin/update_weights", json={"path": str(tmp_path), "version": 7}, timeout=120)
    assert r.status_code == 200 and r.json() == {"version": 7}
    sample = handle.result(120).samples[0]
    assert sample.token_versions[0] == 0 and sample.token_versions[-1] == 7  # both weights, in order
    assert sample.token_versions == sorted(sample.token_versions)
    bad = httpx.post(f"{url}/admin/update_weights", json={"path": str(tmp_path / "nothing")}, timeout=60)
    assert bad.status_code == 400 and engine.weight_version == 7


@pytest.mark.slow
def test_sigint_leaves_no_rank_behind(tmp_path):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "splash_rollout.serve", f"serve.port={port}",
                             "engine.parallel.world_size=2", "engine.parallel.layout=dp", "engine.memory.num_pages=64",
                             "serve.drain_timeout_s=2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", 180)
        ranks = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                 text=True).stdout.split()]
        assert len(ranks) == 2
        proc.send_signal(signal.SIGINT)
        proc.wait(90)
        time.sleep(0.5)
        alive = [p for p in ranks if os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().split()[2]]
        assert not alive, alive
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.stdout.read().decode(errors="replace")
    assert "serving 'glm5-nano'" in output, output[-2000:]
