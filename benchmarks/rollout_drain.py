"""Draining RL rollout on T CPU ranks: each fixed layout, ``auto``, and two transformers peers.

One workload, every system, one invocation (so the ratios come from the same machine state):
``num_prompts`` prompts x ``n`` samples on ``glm5-nano`` (seeded random init, float32), most
prompts short and a few long, response lengths heavy-tailed (seeded log-normal per prompt, clipped),
``ignore_eos`` with a per-prompt ``max_new_tokens`` so every system produces exactly the same
number of tokens. Sampling at temperature 1 (an RL rollout), seeded.

* ``tp``, ``cp``, ``dp``, ``dop``, ``auto``: ``RolloutEngine(EngineConfig(world_size=T, layout=L))``,
  a fresh engine (spawned ranks) per layout, one tiny warm-up call, then the timed ``generate``.
  ``auto_uncorrected`` is ``auto`` with ``online_correction=False``: the policy pricing with
  ``--profile`` as it is, beside the corrected one.
* ``transformers``: ``GlmMoeDsaForCausalLM.generate`` on the same weights (our seeded init saved as
  a HF checkpoint), in this process with ``--threads`` torch threads, left-padded static batches of
  ``--hf-batch`` rows in workload order; a static batch runs until its longest row, which is what
  ``generate`` does with per-row lengths it cannot know in advance. Only requested tokens count.
* ``transformers_cb``: the same checkpoint in transformers' own continuous batching
  (``init_continuous_batching``, paged KV cache, ``sdpa`` attention -- flash needs CUDA), same
  threads. Every sample is its own request with its own ``max_new_tokens`` and EOS off
  (``add_request(..., max_new_tokens=m, eos_token_id=-1)``), so no row runs past its length and no
  bucketing is needed; the cache is sized to hold every request (transformers would otherwise size
  it from the host's free RAM), with the engine's page size, ``--max-num-batched-tokens`` per step and
  ``--max-num-seqs`` running requests; seeded through ``ContinuousBatchingConfig(seed=...)``. One tiny
  request drains through the started manager before the timed drain. transformers 5.24 refuses
  DSA models here: its paged cache knows only ``full_attention`` / ``sliding_attention`` layers
  (GLM-5 declares ``indexed_attention``), stores K/V per attention head rather than MLA's latent, and
  has no indexer-key cache. The run then records the refusal under ``"unavailable"`` and leaves the
  system out of ``tokens_per_s`` and the ratios, instead of timing a different model.

tokens/s = response tokens / wall time of the generate call(s). Writes ``{"tokens_per_s": {...},
"ratio_auto_vs_best_fixed", "ratio_auto_vs_transformers", "ratio_auto_vs_transformers_cb",
"unavailable": {system: why}, "runs": {layout: wall_s, steps, switches, phases, policy_share_of_wall,
correction, ...}, "workload"}``; with ``--rounds R`` every system runs R times round-robin and reports
its median round (all rounds' tokens/s in ``tokens_per_s_rounds``): on shared, loaded cores one run
of a layout can differ from the next by a third.
and optionally a bar chart.

    python benchmarks/rollout_drain.py --json docs/results/rollout_drain.json --png docs/results/rollout_drain.png
    python benchmarks/rollout_drain.py --json /tmp/drain.json --quick   # smoke test, < 1 min
    python benchmarks/rollout_drain.py --json out.json --backends torch_ref,torch   # both backends side by side
    python benchmarks/rollout_drain.py --json /tmp/cb.json --quick --systems dp,transformers,transformers_cb
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams  # noqa: E402
from splash_rollout.models.config import resolve_model  # noqa: E402

FIXED = ("tp", "cp", "dp", "dop")
PEERS = ("transformers", "transformers_cb")
AUTO = ("auto", "auto_uncorrected")
"""``auto``: the policy with θ corrected online from measured steps; ``auto_uncorrected``: the same
policy pricing with the profile as it is (what ``auto`` was before the correction)."""
SYSTEMS = FIXED + AUTO + PEERS
CB_ATTENTION = "sdpa"  # continuous batching accepts sdpa, paged|eager or flash; flash needs CUDA
CB_WAIT_S = 300.0  # longest silence of the continuous-batching loop before the run is declared stuck
FULL = dict(num_prompts=64, n=4, short_prompt=(16, 128), long_prompt=(384, 768), long_fraction=0.125,
            response_mu=float(np.log(48.0)), response_sigma=1.0, min_response=8, max_response=512)
# capacity-bound: a wide queue of short requests and a long tail under a budget (2.5 MiB per rank)
# where DOP's pools admit about twice DP-attention's -- the regime where the layout should follow the
# batch (DOP while the queue lasts, a faster layout once it has drained)
CAPACITY = dict(num_prompts=32, n=1, short_prompt=(16, 40), long_prompt=(50, 64), long_fraction=0.0625,
                response_mu=float(np.log(14.0)), response_sigma=0.6, min_response=8, max_response=160)
CAPACITY_BUDGET_GIB = 2.5 / 1024
QUICK = dict(num_prompts=6, n=2, short_prompt=(8, 32), long_prompt=(96, 160), long_fraction=0.34,
             response_mu=float(np.log(8.0)), response_sigma=0.8, min_response=2, max_response=24)


def make_workload(num_prompts: int, n: int, short_prompt: tuple[int, int], long_prompt: tuple[int, int],
                  long_fraction: float, response_mu: float, response_sigma: float, min_response: int,
                  max_response: int, vocab_size: int, seed: int) -> dict:
    """Prompts (token ids) and one response length per prompt (all n samples share it). The longest
    prompt draw is forced to ``max_response`` so every run has the same tail to drain."""
    rng = np.random.default_rng(seed)
    num_long = max(1, round(long_fraction * num_prompts))
    is_long = np.zeros(num_prompts, bool)
    is_long[rng.choice(num_prompts, num_long, replace=False)] = True
    lens = np.where(is_long, rng.integers(long_prompt[0], long_prompt[1] + 1, num_prompts),
                    rng.integers(short_prompt[0], short_prompt[1] + 1, num_prompts))
    prompts = [rng.integers(2, vocab_size, int(k)).tolist() for k in lens]  # ids 0/1 are bos/eos
    resp = np.clip(np.rint(rng.lognormal(response_mu, response_sigma, num_prompts)), min_response, max_response)
    resp[int(np.argmax(resp))] = max_response
    return {"prompts": prompts, "response_lens": [int(r) for r in resp], "n": n}


def describe(work: dict, params: dict, seed: int) -> dict:
    p = [len(x) for x in work["prompts"]]
    r = work["response_lens"]
    return {**params, "seed": seed, "num_samples": len(p) * work["n"],
            "response_tokens": work["n"] * sum(r), "prompt_tokens": work["n"] * sum(p),
            "prompt_len": {"min": min(p), "mean": float(np.mean(p)), "max": max(p)},
            "response_len": {"min": min(r), "median": float(np.median(r)), "mean": float(np.mean(r)),
                             "p90": float(np.percentile(r, 90)), "max": max(r)},
            "prompt_lens": p, "response_lens": r}


def run_engine(layout: str, work: dict, args, backend: str = "torch") -> dict:
    config = EngineConfig(model=args.model, world_size=args.world_size, layout="auto" if layout in AUTO else layout,
                          seed=args.seed, memory_budget_gib=args.memory_budget_gib,
                          max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                          profile=args.profile, attention_backend=backend,
                          online_correction=layout != "auto_uncorrected")
    sampling = [SamplingParams(n=work["n"], temperature=1.0, max_new_tokens=m, ignore_eos=True, seed=args.seed + i)
                for i, m in enumerate(work["response_lens"])]
    build0 = time.perf_counter()
    with RolloutEngine(config) as engine:
        build_s = time.perf_counter() - build0
        engine.generate([work["prompts"][0][:8]], SamplingParams(temperature=1.0, max_new_tokens=2, seed=0))  # warm-up
        start = time.perf_counter()
        out = engine.generate(work["prompts"], sampling)
        wall = time.perf_counter() - start
    want = [m for m in work["response_lens"] for _ in range(work["n"])]
    got = [len(s.response_ids) for s in out.samples]
    if got != want:
        raise RuntimeError(f"{layout}: response lengths differ from the requested ones")
    tl = out.timeline
    done = [s for s in tl.switches if s["deferred_reason"] is None]
    return {
        "wall_s": wall, "build_s": build_s, "tokens": sum(got), "tokens_per_s": sum(got) / wall,
        "samples": len(got), "steps": int(out.metrics["perf/steps"]),
        "switches": len(done), "deferred_switches": len(tl.switches) - len(done), "attention_backend": backend,
        "control_bytes_max": out.metrics["perf/control_bytes_max"],
        "control_bytes_mean": out.metrics["perf/control_bytes_mean"],
        "switch_overhead_ms": float(sum(s["overhead_ms"] or 0.0 for s in done)),
        "switch_path": [f"{s['src']}->{s['dst']}@{s['step']}" for s in done],
        "max_running": out.metrics.get("perf/max_running"),
        "time_share": {k.split("/")[-1]: v for k, v in out.metrics.items() if k.startswith("layout/time_share/")},
        "phases": [{k: p[k] for k in ("layout", "t_start", "t_end", "steps", "batch_size_start", "batch_size_end",
                                      "tokens")} for p in tl.phases],
        "decisions": len(tl.decisions),
        # the layout driver's own time on rank 0 (consulting and feeding the policy), and what it learned
        "policy_s": out.metrics.get("timing_s/policy", 0.0),
        "policy_share_of_wall": out.metrics.get("timing_s/policy", 0.0) / wall,
        "policy_consults": max((d.get("consults", 0) for d in tl.decisions), default=0),
        "correction": tl.decisions[-1].get("correction") if tl.decisions else None,
        "decision_path": [{"step": d["step"], "event": d.get("event"), "chosen": d["chosen"], "logged": d.get("logged"),
                           "reason": d["reason"]} for d in tl.decisions],
    }


class PeerUnavailable(RuntimeError):
    """transformers refuses this model in the requested mode: the system is reported, not timed."""


def load_hf_peer(args, attn_implementation: str):
    """Our seeded init of ``args.model`` saved as a HF checkpoint and loaded by transformers (float32)."""
    import transformers

    from splash_rollout.models.weights import save_checkpoint
    from splash_rollout.rollout.build import whole_model

    cfg = resolve_model(args.model)
    if cfg.model_type != "glm_moe_dsa":
        raise ValueError(f"--model: the transformers peers map glm_moe_dsa models, got {cfg.model_type}")
    config = EngineConfig(model=args.model, seed=args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(whole_model(config, cfg), tmp)
        return transformers.GlmMoeDsaForCausalLM.from_pretrained(tmp, dtype=torch.float32,
                                                                 attn_implementation=attn_implementation).eval()


def sample_rows(work: dict) -> list[tuple[list[int], int]]:
    """(prompt ids, response length) per sample, the n samples of a prompt next to each other."""
    return [(p, m) for p, m in zip(work["prompts"], work["response_lens"]) for _ in range(work["n"])]


def run_transformers(work: dict, args) -> dict:
    """The same weights in transformers; static left-padded batches of ``args.hf_batch`` rows."""
    hf = load_hf_peer(args, "eager")
    rows = sample_rows(work)
    torch.manual_seed(args.seed)

    def gen(batch: list[tuple[list[int], int]]) -> int:
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, (p, _) in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        longest = max(m for _, m in batch)
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=True,
                          temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0)
        if out.shape[1] - width != longest:
            raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, asked {longest}")
        return len(batch) * longest

    with torch.inference_mode():
        gen([(rows[0][0][:8], 2)])  # warm-up
        start = time.perf_counter()
        computed = sum(gen(rows[i:i + args.hf_batch]) for i in range(0, len(rows), args.hf_batch))
        wall = time.perf_counter() - start
    tokens = sum(m for _, m in rows)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "samples": len(rows),
            "batch_rows": args.hf_batch, "generated_rows_x_steps": computed, "padding_waste": 1 - tokens / computed,
            "torch_threads": torch.get_num_threads()}


def run_transformers_cb(work: dict, args) -> dict:
    """The same weights in transformers' continuous batching (paged cache, ``sdpa`` attention on CPU)."""
    hf = load_hf_peer(args, CB_ATTENTION)
    return drain_continuous(hf, sample_rows(work), args)


def drain_continuous(hf, rows: list[tuple[list[int], int]], args) -> dict:
    """Every row as its own continuous-batching request with its own ``max_new_tokens`` and EOS off.

    The paged cache is sized to hold every row at once (transformers would otherwise size it from the
    host's free RAM), with the engine's page size, token budget per step and running-request cap.
    Raises ``PeerUnavailable`` when transformers will not build a continuous-batching manager for ``hf``."""
    import transformers

    page_size = max(4, EngineConfig().memory.page_size)  # transformers needs at least 4 tokens per page
    num_blocks = sum(-(-(len(p) + m) // page_size) for p, m in rows) + 1
    gen_config = transformers.GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=-1,
                                               max_new_tokens=max(m for _, m in rows))
    cb_config = transformers.ContinuousBatchingConfig(
        page_size=page_size, num_blocks=num_blocks, max_batch_tokens=args.max_num_batched_tokens,
        max_requests_per_batch=args.max_num_seqs, seed=args.seed, auto_switch_to_flash=False)
    with torch.inference_mode():
        try:
            manager = hf.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config)
        except (ValueError, NotImplementedError) as e:
            raise PeerUnavailable(f"transformers {transformers.__version__} continuous batching cannot run "
                                  f"{type(hf).__name__}: {type(e).__name__}: {e}") from e
        manager.start()
        try:
            drain_requests(manager, [(rows[0][0][:8], 2)])  # warm-up
            start = time.perf_counter()
            got = drain_requests(manager, rows)
            wall = time.perf_counter() - start
        finally:
            manager.stop(block=True, timeout=CB_WAIT_S)
            manager.destroy()
    if got != [m for _, m in rows]:
        raise RuntimeError("transformers_cb: response lengths differ from the requested ones")
    tokens = sum(got)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "samples": len(rows),
            "attn_implementation": hf.config._attn_implementation, "page_size": page_size, "num_blocks": num_blocks,
            "max_batch_tokens": args.max_num_batched_tokens, "max_requests_per_batch": args.max_num_seqs,
            "torch_threads": torch.get_num_threads()}


def drain_requests(manager, rows: list[tuple[list[int], int]]) -> list[int]:
    """Submit each row, wait for all of them; the generated length per row, in row order."""
    ids = [manager.add_request(p, request_id=f"row{i}", max_new_tokens=m, eos_token_id=-1)
           for i, (p, m) in enumerate(rows)]
    done: dict[str, list[int]] = {}
    while len(done) < len(ids):
        result = manager.get_result(timeout=CB_WAIT_S)
        if result is None:
            state = "stopped" if not manager.is_running() else f"silent for {CB_WAIT_S} s"
            raise RuntimeError(f"transformers_cb: generation loop {state} with {len(ids) - len(done)} requests open")
        if result.error is not None:
            raise RuntimeError(f"transformers_cb: request {result.request_id} failed: {result.error}")
        if result.is_finished():
            done[result.request_id] = list(result.generated_tokens)
    return [len(done[i]) for i in ids]


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s for s in SYSTEMS if s in result["tokens_per_s"]]  # the headline backend's runs
    vals = [result["tokens_per_s"][s] for s in names]
    colors = {"auto": "tab:orange", "auto_uncorrected": "tab:olive", "transformers": "tab:gray", "transformers_cb": "tab:brown"}
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(names, vals, color=[colors.get(n, "tab:blue") for n in names])
    for b, v in zip(bars, vals):
        ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.0f}", ha="center", va="bottom")
    w = result["workload"]
    ax.set_ylabel("response tokens / s")
    ax.set_title(f"draining rollout: {w['num_prompts']} prompts x n={w['n']}, {w['response_tokens']} tokens, "
                 f"T={result['world_size']}\nauto / best fixed = {result['ratio_auto_vs_best_fixed']:.2f}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _round_ratios(system_runs: list[dict], baseline_runs: list[dict]) -> list[float]:
    """tokens/s of a system over the baseline's, round by round (lists in round order)."""
    return [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(system_runs, baseline_runs)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="output JSON path")
    ap.add_argument("--png", help="bar chart of tokens/s per system")
    ap.add_argument("--quick", action="store_true", help="tiny workload (smoke test)")
    ap.add_argument("--model", default="glm5-nano")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"subset of {','.join(SYSTEMS)}")
    ap.add_argument("--num-prompts", type=int, help="override the workload's prompt count")
    ap.add_argument("--n", type=int, help="override samples per prompt")
    ap.add_argument("--max-response", type=int, help="override the longest response")
    ap.add_argument("--workload", choices=("default", "capacity"), default="default",
                    help="default: 64 prompts x 4, no memory pressure; capacity: 32 requests under 2.5 MiB per rank")
    ap.add_argument("--memory-budget-gib", type=float, help="KV + attention weights per rank (default: the workload's)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--profile", default="cpu", help="hardware profile auto prices layouts with")
    ap.add_argument("--hf-batch", type=int, default=64, help="rows per transformers generate call")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the transformers peers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every system this many times, round-robin; each reports its median round")
    ap.add_argument("--backends", default="torch",
                    help="comma list of attention backends the engine systems run with (e.g. torch_ref,torch): "
                         "each engine system runs once per backend, keyed layout@backend after the first")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds: expected a positive integer, got {args.rounds}")
    systems = [s for s in args.systems.split(",") if s]
    bad = sorted(set(systems) - set(SYSTEMS))
    if bad:
        ap.error(f"--systems: unknown {bad}; choose from {SYSTEMS}")
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # the engine's CPU default; same for the peer

    params = dict(QUICK if args.quick else CAPACITY if args.workload == "capacity" else FULL)
    if args.memory_budget_gib is None:
        args.memory_budget_gib = CAPACITY_BUDGET_GIB if args.workload == "capacity" else 0.25
    for key, val in (("num_prompts", args.num_prompts), ("n", args.n), ("max_response", args.max_response)):
        if val is not None:
            params[key] = val
    work = make_workload(**{k: v for k, v in params.items() if k != "n"}, n=params["n"],
                         vocab_size=resolve_model(args.model).vocab_size, seed=args.seed)
    backends = [b for b in args.backends.split(",") if b]
    runs: dict[str, dict] = {}
    # the last backend's runs carry the plain names (the headline numbers); earlier ones layout@backend
    jobs = [(f"{name}@{b}" if b != backends[-1] else name, name, b) for b in backends for name in systems
            if name not in PEERS or b == backends[-1]]
    peers = {"transformers": run_transformers, "transformers_cb": run_transformers_cb}
    unavailable: dict[str, str] = {}
    every: dict[str, list[dict]] = {key: [] for key, _, _ in jobs}
    for r in range(args.rounds):  # later rounds in reverse order: no system always runs first or last
        for key, name, backend in (jobs if r % 2 == 0 else jobs[::-1]):
            if key in unavailable:
                continue
            t0, load0 = time.perf_counter(), os.getloadavg()[0]
            try:
                run = peers[name](work, args) if name in peers else run_engine(name, work, args, backend)
            except PeerUnavailable as e:  # reported in the JSON, kept out of tokens_per_s and the ratios
                unavailable[key] = str(e)
                print(f"  {key:>16}: not run -- {e}", file=sys.stderr)
                continue
            run["load_average_1min"] = [load0, os.getloadavg()[0]]  # others' work on the same cores
            every[key].append(run)
            print(f"  {key:>16}: {run['tokens_per_s']:8.1f} tokens/s  ({run['wall_s']:.1f} s timed, "
                  f"{time.perf_counter() - t0:.1f} s total)", file=sys.stderr)
    for key, got in every.items():  # each system's median round (the lower middle one of an even count)
        if got:
            runs[key] = dict(sorted(got, key=lambda x: x["tokens_per_s"])[(len(got) - 1) // 2],
                             tokens_per_s_rounds=[x["tokens_per_s"] for x in got])
    tps = {k: v["tokens_per_s"] for k, v in runs.items()}
    vs_peer = {peer: tps["auto"] / tps[peer] if {"auto", peer} <= set(tps) else None for peer in PEERS}
    backend_ratios = {f"{name}: {backends[-1]} / {b}": tps[name] / tps[f"{name}@{b}"]
                      for b in backends[:-1] for name in systems if f"{name}@{b}" in tps}
    fixed = {k: tps[k] for k in FIXED if k in tps}
    best = max(fixed, key=fixed.get) if fixed else None
    by_round = {a: r for a in AUTO if (r := _round_ratios(every.get(a, []), every.get(best, [])))}
    result = {
        "tokens_per_s": tps,
        "ratio_auto_vs_best_fixed": tps["auto"] / fixed[best] if "auto" in tps and best else None,
        "ratio_auto_uncorrected_vs_best_fixed": (tps["auto_uncorrected"] / fixed[best]
                                                 if "auto_uncorrected" in tps and best else None),
        "best_fixed": best,
        # the same ratios round by round (each round runs every system back to back), and their median:
        # on a machine whose speed drifts over minutes, the pairs are what compare like with like
        **{f"ratio_{a}_vs_best_fixed_by_round": r for a, r in by_round.items()},
        **{f"ratio_{a}_vs_best_fixed_median_of_rounds": float(np.median(r)) for a, r in by_round.items()},
        "ratio_auto_vs_transformers": vs_peer["transformers"],
        "ratio_auto_vs_transformers_cb": vs_peer["transformers_cb"],
        "unavailable": unavailable,
        "ratio_backends": backend_ratios,
        "model": args.model, "world_size": args.world_size, "quick": args.quick,
        "engine": {"memory_budget_gib": args.memory_budget_gib, "max_num_batched_tokens": args.max_num_batched_tokens,
                   "max_num_seqs": args.max_num_seqs, "profile": args.profile,
                   "rounds": args.rounds, "attention_backends": backends,
                   "dtype": "float32", "torch_threads_per_rank": max(1, (os.cpu_count() or 1) // args.world_size)},
        "workload": describe(work, params, args.seed),
        "runs": runs,
        "cpu_count": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    if args.png:
        plot(result, args.png)
    print(json.dumps({k: result[k] for k in ("tokens_per_s", "ratio_auto_vs_best_fixed",
                                             "ratio_auto_uncorrected_vs_best_fixed", "best_fixed",
                                             "ratio_auto_vs_transformers", "ratio_auto_vs_transformers_cb",
                                             "unavailable", "ratio_backends")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
