"""Serving: this engine's OpenAI server against vLLM's CPU build's (``vllm serve``) -- same client,
same checkpoint, same arrival traces.

Both servers answer ``/v1/completions`` over HTTP on this machine; one asyncio client (httpx, in this
process) replays each trace against one server at a time, every request streamed (server-sent events)
so the client sees when each token arrives:

* ``poisson``: requests of random prompts (``--prompt-len`` tokens, uniform) asking for ``--new``
  tokens each, arriving as a Poisson process at each of ``--rates`` requests/s (the highest beyond
  what either server sustains here: saturation), ``--requests`` per rate.
* ``agentic``: ``--sessions`` multi-turn sessions started as a Poisson process; each turn asks for
  ``--turn-new`` tokens, then a simulated tool runs (exponential delay, mean ``--tool-delay-s``) and
  the next turn's prompt is the previous prompt + the response's token ids + ``--tool-tokens`` new
  tokens: a session's prompts extend each other, which a prefix cache that outlives a request turns
  into prefills of the new tokens only. Ours runs it twice: with the prefix cache and without
  (``engine.memory.prefix_cache=false``, arm ``ours_nocache``).
* ``concurrency``: ``--concurrent`` requests sent at once to our server, against one in-process
  ``RolloutEngine.generate`` call of the same requests (same engine settings, a fresh process): what
  the HTTP layer, the serving loop and the per-request handles cost.

Per request the client records TTFT (send to the first token), TPOT (the mean gap between its later
tokens) and end-to-end latency; per trace, throughput (generated tokens / the trace's makespan), the
p50 and p99 of each latency, and each server's prefix-cache hit rate from its ``/metrics`` (ours:
``splash_prefix_cache_hit_tokens_total`` over the prompt tokens; vLLM: its ``prefix_cache_hits`` /
``prefix_cache_queries`` counters). Our layout timeline (``/timeline``) is kept with each run.

Each round starts every server fresh (vLLM's start-up includes ~1-2 min of torch.compile), warms it
with untimed requests of the traces' shapes, runs every trace, then stops it; the order of the
servers is reversed every round. Medians over rounds; ratios ours / vLLM of the medians.

The checkpoint (built when ``--checkpoint`` is not given): the DeepSeek-V3 shape of
``peer_engines.py`` (576-wide latent rows, the only width vLLM's CPU MLA kernel takes), random init,
with the 512-token tokenizer of ``glm5-nano`` and a vocabulary of 512 so both servers detokenize
what they send. Setup of the vLLM venv: see ``peer_engines.py`` (``/work/vllm-venv``, tcmalloc).

    python benchmarks/serving.py --json docs/results/serving.json                       # ~35 min
    python benchmarks/serving.py --quick --rounds 1 --json /tmp/serving_quick.json     # smoke run, ~6 min
    python benchmarks/serving.py --arms ours,ours_nocache --json OUT.json               # no vLLM needed
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import peer_engines as pe  # noqa: E402  (the checkpoint, the vLLM environment, machine facts)

sys.path.pop(0)

ARMS = ("ours", "vllm", "ours_nocache")
PARTS = ("poisson", "agentic", "concurrency")
VOCAB = 512
MAX_MODEL_LEN = 4096
VLLM_KVCACHE_GIB = 4
OUR_KV_GIB = 2.0
"""Our KV pool (one rank): the same order as vLLM's 4 GiB, far above what any trace holds at once,
so neither server retracts or preempts for memory."""
DEFAULTS = dict(rates="2,6,32", requests=96, prompt_len="64,256", new=64,
                sessions=16, turns=6, system_tokens=1024, user_tokens=64, turn_new=32, tool_tokens=256,
                tool_delay_s=0.1, session_rate=4.0, concurrent=48, concurrent_prompt_len=128, concurrent_new=64)
QUICK = dict(rates="2,8", requests=16, prompt_len="32,64", new=16,
             sessions=4, turns=3, system_tokens=128, user_tokens=16, turn_new=8, tool_tokens=64,
             tool_delay_s=0.05, session_rate=4.0, concurrent=8, concurrent_prompt_len=32, concurrent_new=16)
START_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 900


# ---------------------------------------------------------------------------------------------
# traces: what is sent and when (deterministic from --seed)
# ---------------------------------------------------------------------------------------------
def poisson_trace(rate: float, count: int, prompt_len: tuple[int, int], new: int, seed: int) -> list[dict]:
    """``count`` requests: arrival offsets (s) of a Poisson process at ``rate``/s, random prompts."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(count):
        out.append({"at": t, "prompt": [rng.randrange(2, VOCAB) for _ in range(rng.randint(*prompt_len))],
                    "max_tokens": new, "seed": seed * 100_000 + i})
        t += rng.expovariate(rate)
    return out


def agentic_trace(o: dict, seed: int) -> list[dict]:
    """Per session: its start offset, its first prompt, each later turn's tool delay and tool tokens."""
    rng = random.Random(seed)
    t, sessions = 0.0, []
    for s in range(o["sessions"]):
        first = [rng.randrange(2, VOCAB) for _ in range(o["system_tokens"] + o["user_tokens"])]
        later = [{"delay_s": rng.expovariate(1.0 / o["tool_delay_s"]) if o["tool_delay_s"] > 0 else 0.0,
                  "tool": [rng.randrange(2, VOCAB) for _ in range(o["tool_tokens"])]} for _ in range(o["turns"] - 1)]
        sessions.append({"at": t, "first": first, "later": later, "seed": seed * 100_000 + s * 100})
        t += rng.expovariate(o["session_rate"])
    return sessions


# ---------------------------------------------------------------------------------------------
# the client
# ---------------------------------------------------------------------------------------------
async def whole_completion(client, url: str, model: str, prompt: list[int], max_tokens: int, seed: int) -> dict:
    """One completion answered whole (no stream), as a trainer's rollout worker asks for it."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed,
            "ignore_eos": True, "return_token_ids": True}
    sent = time.perf_counter()
    r = await client.post(f"{url}/v1/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:500]}")
    end = time.perf_counter()
    tokens = r.json()["usage"]["completion_tokens"]
    return {"sent": sent, "end": end, "ttft_s": None, "tpot_s": None, "e2e_s": end - sent, "tokens": tokens,
            "token_ids": r.json()["choices"][0].get("token_ids"), "prompt_tokens": len(prompt)}


async def stream_completion(client, url: str, model: str, prompt: list[int], max_tokens: int, seed: int) -> dict:
    """One streamed completion: its timings and token ids (``return_token_ids``; a server that sends
    none is counted by its chunks)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    sent = time.perf_counter()
    stamps: list[float] = []
    ids: list[int] = []
    chunks_with_ids = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:500]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                got = choice.get("token_ids")
                if got:
                    chunks_with_ids += 1
                    ids += got
                    stamps += [now] * len(got)
                elif choice.get("text") and got is None:
                    stamps.append(now)
    end = time.perf_counter()
    tokens = len(ids) if chunks_with_ids else len(stamps)
    ttft = stamps[0] - sent if stamps else None
    tpot = (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 and stamps else None
    return {"sent": sent, "end": end, "ttft_s": ttft, "tpot_s": tpot, "e2e_s": end - sent, "tokens": tokens,
            "token_ids": ids, "prompt_tokens": len(prompt)}


def percentile(values: list[float], q: float) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(records: list[dict], started: float) -> dict:
    end = max(r["end"] for r in records)
    tokens = sum(r["tokens"] for r in records)
    out = {"requests": len(records), "generated_tokens": tokens, "prompt_tokens": sum(r["prompt_tokens"] for r in records),
           "makespan_s": end - started, "throughput_tok_s": tokens / (end - started),
           "requests_per_s": len(records) / (end - started)}
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        vals = [r[key] for r in records]
        out[key.replace("_s", "")] = {"p50_s": percentile(vals, 0.5), "p99_s": percentile(vals, 0.99),
                                      "mean_s": statistics.fmean([v for v in vals if v is not None]) if any(
                                          v is not None for v in vals) else None}
    return out


async def run_poisson(url: str, model: str, trace: list[dict]) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        started = time.perf_counter()

        async def one(req):
            await asyncio.sleep(max(0.0, started + req["at"] - time.perf_counter()))
            return await stream_completion(client, url, model, req["prompt"], req["max_tokens"], req["seed"])

        records = await asyncio.gather(*(one(r) for r in trace))
    return summarize(records, started)


async def run_agentic(url: str, model: str, sessions: list[dict], turn_new: int) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        started = time.perf_counter()

        async def session(s):
            await asyncio.sleep(max(0.0, started + s["at"] - time.perf_counter()))
            prompt, turns = list(s["first"]), []
            for k in range(len(s["later"]) + 1):
                if k:
                    await asyncio.sleep(s["later"][k - 1]["delay_s"])
                    prompt = prompt + turns[-1]["token_ids"] + s["later"][k - 1]["tool"]
                turns.append(await stream_completion(client, url, model, prompt, turn_new, s["seed"] + k))
                turns[-1]["turn"] = k
            return turns

        per_session = await asyncio.gather(*(session(s) for s in sessions))
    records = [t for turns in per_session for t in turns]
    out = summarize(records, started)
    later = [t for t in records if t["turn"] > 0]
    out["later_turns"] = {"ttft": {"p50_s": percentile([t["ttft_s"] for t in later], 0.5),
                                   "p99_s": percentile([t["ttft_s"] for t in later], 0.99)},
                          "prompt_tokens": sum(t["prompt_tokens"] for t in later)}
    return out


async def run_concurrent(url: str, model: str, prompts: list[list[int]], new: int, seed: int) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        started = time.perf_counter()
        records = await asyncio.gather(*(whole_completion(client, url, model, p, new, seed + i)
                                         for i, p in enumerate(prompts)))
    return summarize(records, started)


# ---------------------------------------------------------------------------------------------
# servers
# ---------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> dict[str, float]:
    """The server's Prometheus counters and gauges, summed over label sets, by metric name."""
    import httpx

    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m:
            try:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
            except ValueError:
                pass
    return out


def hit_rate(arm: str, before: dict, after: dict, prompt_tokens: int) -> dict:
    """Prompt tokens the server took from its prefix cache during a trace, over the trace's prompt tokens."""
    def delta(*names):
        for n in names:
            if n in after:
                return after[n] - before.get(n, 0.0)
        return None

    if arm.startswith("ours"):
        hits = delta("splash_prefix_cache_hit_tokens_total")
        return {"hit_tokens": hits, "prompt_tokens": prompt_tokens,
                "hit_rate": hits / prompt_tokens if hits is not None and prompt_tokens else None}
    hits, queries = delta("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits"), \
        delta("vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries")
    return {"hit_tokens": hits, "query_tokens": queries, "prompt_tokens": prompt_tokens,
            "hit_rate": (hits / queries if queries else 0.0) if hits is not None and queries is not None else None}


class ServerProcess:
    """One server, started in its own session (stopped with everything it spawned), logs in ``work``."""

    def __init__(self, arm: str, argv: list[str], env_delta: dict, env_remove: tuple[str, ...], log_stem: str,
                 port: int, model: str) -> None:
        self.arm, self.argv, self.port, self.model = arm, argv, port, model
        self.url = f"http://127.0.0.1:{port}"
        self.command = pe.command_line(env_delta, argv, env_remove)
        env = {k: v for k, v in os.environ.items() if k not in env_remove}
        env.update(env_delta)
        self.log_path = log_stem + ".log"
        self._log = open(self.log_path, "w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._wait_ready()
        self.startup_s = time.perf_counter() - t0

    def _wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.arm}: the server exited with {self.proc.returncode} before it was ready; "
                                   f"log tail:\n{pe.tail(self.log_path, 3000)}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.arm}: not ready within {START_TIMEOUT_S} s; log tail:\n{pe.tail(self.log_path, 3000)}")

    def stop(self) -> None:
        pe.kill_group(self.proc)
        self._log.close()


def our_overrides(ckpt: str, dtype: str, port: int, prefix_cache: bool, extra: Sequence[str] = ()) -> list[str]:
    """``python -m splash_rollout.serve`` overrides: the checkpoint on one rank (T = 1: fastest on two
    cores, see peer_engines.py), the engine's defaults otherwise; ``extra`` (``--ours-override``) last."""
    return [f"model.path={ckpt}", f"model.dtype={dtype}", f"serve.port={port}", "serve.log_level=warning",
            "engine.parallel.world_size=1", "engine.parallel.layout=tp", f"engine.model.max_model_len={MAX_MODEL_LEN}",
            f"engine.memory.memory_budget_gib={OUR_KV_GIB}", "engine.compute.numerics=fast",
            f"engine.memory.prefix_cache={str(prefix_cache).lower()}", *extra]


def start_server(arm: str, args, ckpt: str, work: str, tag: str, envs: dict) -> ServerProcess:
    port = free_port()
    stem = os.path.join(work, "logs", f"{tag}_{arm}")
    if arm == "vllm":
        argv = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", ckpt, "--dtype", args.dtype,
                "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0", "--max-num-seqs", "256",
                "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "bench"]
        return ServerProcess(arm, argv, envs["vllm"], (), stem, port, "bench")
    argv = [sys.executable, "-m", "splash_rollout.serve", *our_overrides(ckpt, args.dtype, port, arm != "ours_nocache", args.ours_override),
            "serve.served_model_name=bench"]
    return ServerProcess(arm, argv, envs["ours"], envs["ours_remove"], stem, port, "bench")


# ---------------------------------------------------------------------------------------------
# the in-process reference of the concurrency part
# ---------------------------------------------------------------------------------------------
def child_generate(spec: dict) -> dict:
    """One RolloutEngine built from the server's own overrides; an untimed call of the same shape
    (other prompts: nothing for the prefix cache), then the timed generate."""
    from hydra import compose, initialize_config_dir

    from splash_rollout import RolloutEngine, SamplingParams
    from splash_rollout.recipes.engine_config import engine_config
    from splash_rollout.serve.__main__ import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="serve", overrides=spec["overrides"])
    engine = RolloutEngine(engine_config(cfg))
    try:
        engine.generate(spec["warm_prompts"], [SamplingParams(temperature=1.0, max_new_tokens=spec["new"],
                                                              ignore_eos=True, seed=7 + i)
                                               for i in range(len(spec["warm_prompts"]))])
        params = [SamplingParams(temperature=1.0, max_new_tokens=spec["new"], ignore_eos=True, seed=spec["seed"] + i)
                  for i in range(len(spec["prompts"]))]
        t0 = time.perf_counter()
        batch = engine.generate(spec["prompts"], params)
        wall = time.perf_counter() - t0
    finally:
        engine.shutdown()
    tokens = sum(len(s.response_ids) for s in batch.samples)
    return {"generated_tokens": tokens, "wall_s": wall, "throughput_tok_s": tokens / wall}


def run_generate_child(spec: dict, work: str, tag: str, envs: dict) -> dict:
    stem = os.path.join(work, "logs", f"{tag}_generate")
    pe._dump(spec, stem + ".spec.json")
    env = {k: v for k, v in os.environ.items() if k not in envs["ours_remove"]}
    env.update(envs["ours"])
    argv = [sys.executable, os.path.abspath(__file__), "--child-generate", stem + ".spec.json", stem + ".result.json"]
    with open(stem + ".log", "w") as log:
        rc = subprocess.run(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=REQUEST_TIMEOUT_S).returncode
    if rc != 0 or not os.path.isfile(stem + ".result.json"):
        raise RuntimeError(f"in-process generate: exited with {rc}; log tail:\n{pe.tail(stem + '.log', 3000)}")
    out = pe._load(stem + ".result.json")
    out["command"] = pe.command_line(envs["ours"], argv, envs["ours_remove"])
    return out


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def build_checkpoint(work: str, seed: int) -> str:
    """The peer_engines DeepSeek-V3 shape with a 512-token vocabulary and glm5-nano's tokenizer."""
    from splash_rollout.models.tokenizer import NANO_TOKENIZER

    ckpt = os.path.join(work, "checkpoint")
    if not os.path.isfile(os.path.join(ckpt, "model.safetensors")):
        runner = pe.Runner(work, 1800, pe.WARMUP)
        rec = runner.run("checkpoint", sys.executable, "checkpoint",
                         {"dir": ckpt, "seed": seed, "config": {**pe.CHECKPOINT_CONFIG, "vocab_size": VOCAB,
                                                                 "max_position_embeddings": MAX_MODEL_LEN}}, {})
        if "result" not in rec:
            raise SystemExit(f"building the checkpoint failed: {rec.get('error')}\n{rec.get('stderr_tail')}")
    shutil.copy(NANO_TOKENIZER, os.path.join(ckpt, "tokenizer.json"))
    pe._dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
              "model_max_length": MAX_MODEL_LEN}, os.path.join(ckpt, "tokenizer_config.json"))
    return ckpt


def warm_up(server: ServerProcess, o: dict, seed: int) -> None:
    """Untimed: requests of the traces' shapes (vLLM compiles per shape on its first requests)."""
    lo, hi = o["prompt_len"]
    warm = poisson_trace(1000.0, 16, (lo, hi), min(o["new"], 16), seed + 999)
    asyncio.run(run_poisson(server.url, server.model, warm))
    long = [{"at": 0.0, "prompt": [5] * (o["system_tokens"] + o["user_tokens"] + o["turns"] * o["tool_tokens"]),
             "max_tokens": 4, "seed": 1}]
    asyncio.run(run_poisson(server.url, server.model, long))


def run_round(r: int, arms: list[str], parts: list[str], args, o: dict, ckpt: str, work: str, envs: dict,
              traces: dict, out: dict) -> None:
    order = arms if r % 2 == 0 else list(reversed(arms))
    for arm in order:
        wanted = [p for p in parts if arm != "ours_nocache" or p == "agentic"]
        wanted = [p for p in wanted if arm == "ours" or p != "concurrency"]
        if not wanted:
            continue
        tag = f"round{r}"
        print(f"[serving] {tag}/{arm}: starting the server ...", flush=True)
        try:
            server = start_server(arm, args, ckpt, work, tag, envs)
        except RuntimeError as e:
            out["failures"].append({"round": r, "arm": arm, "where": "start", "error": str(e)[-3000:]})
            print(f"[serving] {tag}/{arm}: FAILED to start: {str(e)[-1500:]}", file=sys.stderr, flush=True)
            continue
        run = {"command": server.command, "startup_s": server.startup_s, "log": server.log_path, "traces": {}}
        try:
            warm_up(server, o, args.seed)
            for part in wanted:
                for name, trace in traces[part].items():
                    if part == "concurrency":  # the in-process reference, right before or after the server's run
                        continue
                    before = scrape(server.url)
                    load = os.getloadavg()[0]
                    if part == "poisson":
                        res = asyncio.run(run_poisson(server.url, server.model, trace))
                    elif part == "agentic":
                        res = asyncio.run(run_agentic(server.url, server.model, trace, o["turn_new"]))
                    res["prefix_cache"] = hit_rate(arm, before, scrape(server.url), res["prompt_tokens"])
                    if part == "agentic" and res["prefix_cache"].get("hit_tokens") is not None:
                        # first turns share nothing: every cached token belongs to a later turn
                        res["prefix_cache"]["later_turn_hit_fraction"] = (res["prefix_cache"]["hit_tokens"]
                                                                          / res["later_turns"]["prompt_tokens"])
                    res["load_avg_1min_before"] = load
                    run["traces"][name] = res
                    print(f"[serving] {tag}/{arm}/{name}: {res['throughput_tok_s']:.1f} tok/s, TTFT p50 "
                          f"{res['ttft']['p50_s']:.3f} s p99 {res['ttft']['p99_s']:.3f} s, hit rate "
                          f"{res['prefix_cache'].get('hit_rate')}", flush=True)
            if "concurrency" in wanted:
                prompts, new = traces["concurrency"]["prompts"], o["concurrent_new"]
                warm_prompts = traces["concurrency"]["warm_prompts"]
                spec = {"overrides": [x for x in our_overrides(ckpt, args.dtype, 0, True, args.ours_override) if not x.startswith("serve.")],
                        "prompts": prompts, "warm_prompts": warm_prompts, "new": new, "seed": args.seed * 1000}
                first = "http" if r % 2 == 0 else "generate"
                for which in ([first, "generate" if first == "http" else "http"]):
                    if which == "http":  # the same untimed call of the same shape first, as the child makes
                        asyncio.run(run_concurrent(server.url, server.model, warm_prompts, new, 7))
                        res = asyncio.run(run_concurrent(server.url, server.model, prompts, new, spec["seed"]))
                        run["traces"]["concurrency_http"] = res
                    else:
                        res = run_generate_child(spec, work, tag, envs)
                        run["traces"]["concurrency_generate"] = res
                    print(f"[serving] {tag}/{arm}/concurrency_{which}: {res['throughput_tok_s']:.1f} tok/s", flush=True)
            if arm.startswith("ours"):
                import httpx

                run["timeline"] = httpx.get(f"{server.url}/timeline", timeout=60).json()
        except Exception as e:  # noqa: BLE001 - a failed arm is recorded; the other arms still run
            out["failures"].append({"round": r, "arm": arm, "where": "traces", "error": f"{type(e).__name__}: {e}"[-3000:],
                                    "log_tail": pe.tail(server.log_path, 2000)})
            print(f"[serving] {tag}/{arm}: FAILED: {e}", file=sys.stderr, flush=True)
        finally:
            server.stop()
        out["rounds"].setdefault(str(r), {})[arm] = run


def medians(out: dict, arms: list[str]) -> dict:
    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    cells: dict = {}
    names = sorted({n for rnd in out["rounds"].values() for run in rnd.values() for n in run["traces"]})
    for name in names:
        cell = {}
        for arm in arms:
            runs = [rnd[arm]["traces"][name] for rnd in out["rounds"].values() if arm in rnd and name in rnd[arm]["traces"]]
            if not runs:
                continue
            cell[arm] = {"runs": len(runs), "throughput_tok_s": med([x["throughput_tok_s"] for x in runs])}
            for key in ("ttft", "tpot", "e2e"):
                if key in runs[0]:
                    cell[arm][key] = {q: med([x[key][q] for x in runs]) for q in ("p50_s", "p99_s")}
            if "prefix_cache" in runs[0]:
                cell[arm]["prefix_cache_hit_rate"] = med([x["prefix_cache"].get("hit_rate") for x in runs])
                later = [x["prefix_cache"].get("later_turn_hit_fraction") for x in runs]
                if any(v is not None for v in later):
                    cell[arm]["later_turn_hit_fraction"] = med(later)
        if "ours" in cell and "vllm" in cell:
            cell["throughput_ours_over_vllm"] = cell["ours"]["throughput_tok_s"] / cell["vllm"]["throughput_tok_s"]
            if "ttft" in cell["ours"] and cell["vllm"]["ttft"]["p99_s"]:
                cell["ttft_p99_ours_over_vllm"] = cell["ours"]["ttft"]["p99_s"] / cell["vllm"]["ttft"]["p99_s"]
        if "ours" in cell and "ours_nocache" in cell:
            cell["throughput_cache_over_nocache"] = (cell["ours"]["throughput_tok_s"]
                                                     / cell["ours_nocache"]["throughput_tok_s"])
        cells[name] = cell
    http, gen = cells.get("concurrency_http", {}).get("ours"), cells.get("concurrency_generate", {}).get("ours")
    if http and gen:
        cells["concurrency"] = {"http_over_generate": http["throughput_tok_s"] / gen["throughput_tok_s"]}
    return cells


def markdown(summary: dict) -> str:
    def f(x, spec=".1f"):
        return "—" if x is None else format(x, spec)

    lines = ["| trace | arm | tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | e2e p50 / p99 (s) | cache hit rate |",
             "|---|---|---|---|---|---|---|"]
    for name, cell in summary.items():
        for arm in ARMS:
            c = cell.get(arm) if isinstance(cell, dict) else None
            if not c:
                continue
            ttft, tpot, e2e = c.get("ttft", {}), c.get("tpot", {}), c.get("e2e", {})
            lines.append(f"| {name} | {arm} | {f(c['throughput_tok_s'])} | {f(ttft.get('p50_s'), '.3f')} / "
                         f"{f(ttft.get('p99_s'), '.3f')} | {f((tpot.get('p50_s') or 0) * 1e3)} / "
                         f"{f((tpot.get('p99_s') or 0) * 1e3)} | {f(e2e.get('p50_s'), '.2f')} / {f(e2e.get('p99_s'), '.2f')} "
                         f"| {f(c.get('prefix_cache_hit_rate'), '.2f')} |")
    ratios = {name: {k: v for k, v in cell.items() if "_over_" in k} for name, cell in summary.items()}
    lines.append("")
    lines += [f"- {name}: " + ", ".join(f"{k} {v:.2f}x" for k, v in r.items()) for name, r in ratios.items() if r]
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {ARMS}")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {PARTS}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="small traces (a smoke run)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--checkpoint", help="a DeepSeek-V3-shaped checkpoint folder with a tokenizer (default: build one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="threads per server's engine")
    ap.add_argument("--splash-env", choices=("own", "same"), default="own",
                    help="own: our server under the plain allocator and OpenMP; same: under vLLM's preloads")
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", "/work/vllm-venv/bin/python"))
    ap.add_argument("--tcmalloc", default=pe.TCMALLOC)
    ap.add_argument("--work-dir", default="/tmp/serving_bench")
    ap.add_argument("--json", required=False)
    ap.add_argument("--ours-override", action="append", default=[], metavar="KEY=VALUE",
                    help="a Hydra override for our server (repeatable), after the benchmark's own")
    for key, value in DEFAULTS.items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None,
                        help=f"default {value} (quick: {QUICK[key]})")
    ap.add_argument("--child-generate", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_generate:
        sys.path.insert(0, ROOT)  # this tree's splash_rollout, as `python -m splash_rollout.serve` from ROOT takes
        pe._dump(child_generate(pe._load(args.child_generate[0])), args.child_generate[1])
        return {}

    arms = [a for a in args.arms.split(",") if a]
    parts = [p for p in args.parts.split(",") if p]
    for name, given, allowed in (("--arms", arms, ARMS), ("--parts", parts, PARTS)):
        bad = [x for x in given if x not in allowed]
        if bad or not given:
            raise SystemExit(f"{name}: expected a comma list of {allowed}, got {bad or given}")
    if args.rounds < 1:
        raise SystemExit("--rounds: expected >= 1")
    o = {k: (getattr(args, k) if getattr(args, k) is not None else (QUICK if args.quick else DEFAULTS)[k])
         for k in DEFAULTS}
    try:
        o["rates"] = [float(x) for x in str(o["rates"]).split(",")]
        o["prompt_len"] = tuple(int(x) for x in str(o["prompt_len"]).split(","))
        assert len(o["prompt_len"]) == 2 and 1 <= o["prompt_len"][0] <= o["prompt_len"][1] and all(x > 0 for x in o["rates"])
    except (ValueError, AssertionError):
        raise SystemExit(f"--rates: positive numbers, --prompt-len: LO,HI with 1 <= LO <= HI; got {o['rates']!r}, "
                         f"{o['prompt_len']!r}") from None
    longest = o["system_tokens"] + o["user_tokens"] + (o["turns"] - 1) * (o["turn_new"] + o["tool_tokens"]) + o["turn_new"]
    if longest > MAX_MODEL_LEN or o["prompt_len"][1] + o["new"] > MAX_MODEL_LEN:
        raise SystemExit(f"a session's last turn reaches {longest} tokens; both servers run max_model_len {MAX_MODEL_LEN}")

    iomp = os.path.join(os.path.dirname(os.path.dirname(args.vllm_python)), "lib", "libiomp5.so")
    if "vllm" in arms or args.splash_env == "same":
        for path, what in ((args.vllm_python, "--vllm-python"), (iomp, "the vLLM venv's libiomp5.so"),
                           (args.tcmalloc, "--tcmalloc")):
            if not os.path.isfile(path):
                raise SystemExit(f"{what}: {path!r} missing -- set up the vLLM venv as peer_engines.py's docstring says, "
                                 f"or run --arms ours,ours_nocache")
    preload = {"LD_PRELOAD": f"{args.tcmalloc}:{iomp}", "OMP_NUM_THREADS": str(args.threads)}
    envs = {"vllm": {**preload, "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KVCACHE_GIB),
                     "VLLM_CPU_OMP_THREADS_BIND": "0" if args.threads == 1 else f"0-{args.threads - 1}"},
            "ours": {**(preload if args.splash_env == "same" else {"OMP_NUM_THREADS": str(args.threads)})},
            "ours_remove": () if args.splash_env == "same" else ("LD_PRELOAD",)}

    work = os.path.abspath(args.work_dir)
    os.makedirs(os.path.join(work, "logs"), exist_ok=True)
    ckpt = os.path.abspath(args.checkpoint) if args.checkpoint else build_checkpoint(work, args.seed)
    raw = pe.check_checkpoint(ckpt)
    if int(raw["vocab_size"]) > VOCAB and not os.path.isfile(os.path.join(ckpt, "tokenizer.json")):
        raise SystemExit(f"--checkpoint {ckpt!r}: needs a tokenizer.json (both servers detokenize)")
    rng_seed = args.seed
    traces = {"poisson": {f"poisson_{rate:g}": poisson_trace(rate, o["requests"], o["prompt_len"], o["new"],
                                                             rng_seed + i + 1)
                          for i, rate in enumerate(o["rates"])} if "poisson" in parts else {},
              "agentic": {"agentic": agentic_trace(o, rng_seed + 77)} if "agentic" in parts else {},
              "concurrency": {}}
    if "concurrency" in parts:
        rng = random.Random(rng_seed + 55)
        traces["concurrency"] = {key: [[rng.randrange(2, VOCAB) for _ in range(o["concurrent_prompt_len"])]
                                       for _ in range(o["concurrent"])] for key in ("prompts", "warm_prompts")}
    out = {"benchmark": "serving",
           "command": " ".join(["python", "benchmarks/serving.py", *(argv if argv is not None else sys.argv[1:])]),
           "machine": pe.machine_facts(args.vllm_python if "vllm" in arms else None),
           "settings": {**{k: v for k, v in o.items()}, "arms": arms, "parts": parts, "rounds": args.rounds,
                        "dtype": args.dtype, "threads": args.threads, "splash_env": args.splash_env,
                        "max_model_len": MAX_MODEL_LEN, "vllm_kvcache_gib": VLLM_KVCACHE_GIB,
                        "our_kv_gib": OUR_KV_GIB, "ours_overrides": args.ours_override, "checkpoint": ckpt},
           "envs": envs, "rounds": {}, "failures": []}

    def save():
        if args.json:
            out["summary"] = medians(out, arms)
            out["table_markdown"] = markdown(out["summary"])
            pe._dump(out, args.json)

    t0 = time.perf_counter()
    for r in range(args.rounds):
        run_round(r, arms, parts, args, o, ckpt, work, envs, traces, out)
        save()
    out["timing_s"] = time.perf_counter() - t0
    out["summary"] = medians(out, arms)
    out["table_markdown"] = markdown(out["summary"])
    save()
    print(out["table_markdown"], flush=True)
    return out


if __name__ == "__main__":
    main()
