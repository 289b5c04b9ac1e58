"""One prepared check of the GPU backends: parity, bandwidth, engine tokens, decode throughput.

Parts (each runs in its own try; a failure records its traceback and the next part runs):

* ``env``: torch / CUDA / Triton / flash_mla / transformers versions and what imports;
* ``kernel_parity``: the ``triton`` and ``flashmla`` backends against ``torch_ref`` on the device,
  DeepSeek dims (kv_lora_rank 512, rope 64), page size 64, NaN-filled pools, decode and prefill rows,
  causal and DSA-selected, pages stored elsewhere; max abs error of out and lse per dtype;
* ``kernel_bandwidth``: one layer's decode attention per backend at B in {64, 256}, timed, as
  achieved GB/s of the KV it must read and the ratio to the HBM bound;
* ``engine_cuda_vs_cpu``: the single-rank engine (``glm5-nano``, float32) on the device with each
  backend against the CPU engine: the same greedy tokens, logprob difference;
* ``decode_throughput``: the engine's decode tokens/s at B in {1, 64, 256} on a random-init model
  with DeepSeek-V2-Lite's attention dimensions in bfloat16, per backend, next to the HBM-bandwidth
  bound of the weights and KV a step reads; decode-only rates come from two runs of different
  lengths (their difference cancels prefill);
* ``transformers_peer``: transformers' ``generate`` on the same model shape, device and batch sizes;
* ``speculation``: the single-rank engine (``glm5-nano``; the torch backend under reproducible
  numerics, Triton under fast) with ``speculation`` off, always and auto on groups that repeat their
  prompt (a call to fill the drafter's history, then one measured): the same tokens as ``off``, the
  largest logprob difference (0 under reproducible), engine steps, seconds, acceptance.
* ``cuda_graph``: decode steps replayed from CUDA graphs against the eager engine, in one invocation
  with the arms alternated (eager, graphed, eager, graphed) at B in {1, 64, 256} on the throughput
  model (bfloat16, Triton): ms per decode step against the HBM bound, graphed / eager, kernel
  launches and host syncs per decode step (torch.profiler), the graphed forward run under
  ``torch.cuda.set_sync_debug_mode("error")`` (a sync raises), the engine's own host-sync count
  (``HostSyncs``) per step, the graphs' memory; and the tokens of graphed and eager greedy runs of
  ``glm5-nano`` in float32 (DSA + MoE: the Triton expert kernel) compared one by one.
* ``sharded_load``: a MoE checkpoint (glm5-nano's shape, 64 experts of width 1536, bfloat16) written
  to a temporary folder and loaded by a one-rank engine on the device: peak GPU memory of the load
  against the weights + KV pool it holds, and the peak anonymous host memory against the weights
  (the files are memory-mapped: their pages are the kernel's page cache); then a short generate.

The JSON (``device_check.json`` under ``--out``, default ``$OUT``) is rewritten after every part,
so a run cut short keeps what finished. ``--cpu --tiny`` runs every part on small shapes on the CPU
(Triton under its interpreter) to check the script itself.

    python scripts/device_check.py --out "$OUT"            # on the GPU machine (device_check.sh)
    python scripts/device_check.py --cpu --tiny --out /tmp/dc
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
import traceback

PARTS = ("env", "kernel_parity", "engine_cuda_vs_cpu", "cuda_graph", "sharded_load", "decode_throughput",
         "speculation", "transformers_peer", "kernel_bandwidth")
BACKENDS = ("torch", "triton", "flashmla")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "device_check_out"), help="folder for device_check.json")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (Triton under TRITON_INTERPRET=1)")
    ap.add_argument("--tiny", action="store_true", help="small shapes and batches (a check of the script)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--budget-s", type=float, default=420.0, help="parts not started by then are skipped")
    ap.add_argument("--layers", type=int, default=8, help="layers of the throughput model")
    ap.add_argument("--hbm-gbps", type=float, default=4800.0, help="HBM bandwidth of the device (H200: 4.8 TB/s)")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.parts.split(",")) - set(PARTS))
    if unknown:
        ap.error(f"--parts: unknown {unknown}; expected names from {PARTS}")
    return args


# ---- shared helpers ---------------------------------------------------------------------------------
class Ctx:
    def __init__(self, args):
        import torch

        self.args, self.tiny, self.torch = args, args.tiny, torch
        self.device = "cpu" if args.cpu else "cuda"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available: run with --cpu --tiny to check the script on a CPU")

    def sync(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def timed(self, fn, repeat: int) -> float:
        """Median seconds of ``fn()`` over ``repeat`` runs after one warm-up."""
        fn()
        self.sync()
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]


def backend_or_reason(name: str):
    """(backend, None) or (None, why it cannot be built here)."""
    from splash_rollout.engine.attention import get_backend

    try:
        return get_backend(name), None
    except Exception as exc:  # noqa: BLE001 -- recorded, the part goes on with the other backends
        return None, f"{type(exc).__name__}: {exc}"


def attention_case(ctx, dtype, page: int, r: int, rope: int, heads: int, requests, elsewhere: bool, seed: int):
    """A NaN-filled pool holding each request's history at scattered pages (every third logical page
    -1 with ``elsewhere``), the batch and its queries."""
    torch = ctx.torch
    from splash_rollout.engine.forward_batch import ForwardBatch
    from splash_rollout.engine.kv_pool import KVPool, KVPoolSpec

    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-s // page) for s, _ in requests) + 2
    pool = KVPool(KVPoolSpec(r, rope, (0,)), num_pages, page, dtype=dtype, device=ctx.device)
    pool.fill_(float("nan"))
    free = torch.randperm(num_pages, generator=g).tolist()
    items, slots, values = [], [], []
    for s, n in requests:
        pages = [free.pop() for _ in range(-(-s // page))]
        if elsewhere:
            pages = [-1 if i % 3 == 1 else p for i, p in enumerate(pages)]
        for pos in range(s):
            if pages[pos // page] >= 0:
                slots.append(pages[pos // page] * page + pos % page)
        items.append((list(range(n)), s - n, n, pages, True))
    kv = torch.randn(len(slots), r + rope, generator=g)
    pool.write_kv(0, torch.tensor(slots, device=ctx.device), kv[:, :r].to(ctx.device), kv[:, r:].to(ctx.device))
    batch = ForwardBatch.build(items, page_size=page, device=ctx.device)
    q = torch.randn(batch.num_tokens, heads, r, generator=g).to(ctx.device, dtype)
    q_pe = torch.randn(batch.num_tokens, heads, rope, generator=g).to(ctx.device, dtype)
    return pool, batch, q, q_pe


def compare(got, ref) -> dict:
    torch = sys.modules["torch"]
    out, lse = got
    ref_out, ref_lse = ref
    finite = torch.isfinite(ref_lse)
    return {"max_abs_out": float((out.float() - ref_out.float()).abs().max()),
            "max_abs_lse": float((lse[finite].float() - ref_lse[finite].float()).abs().max()) if finite.any() else 0.0,
            "nan_in_out": bool(torch.isnan(out).any()),
            "empty_rows_agree": bool(torch.equal(finite, torch.isfinite(lse)))}


# ---- parts --------------------------------------------------------------------------------------------
def part_env(ctx) -> dict:
    import importlib

    torch = ctx.torch
    info = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(), "device": ctx.device}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = list(torch.cuda.get_device_capability(0))
    for module in ("triton", "flash_mla", "transformers", "numpy"):
        try:
            info[module] = getattr(importlib.import_module(module), "__version__", "imported")
        except Exception as exc:  # noqa: BLE001
            info[module] = f"not importable: {type(exc).__name__}: {exc}"
    return info


def part_kernel_parity(ctx) -> dict:
    torch = ctx.torch
    from splash_rollout.engine.attention import get_backend
    from splash_rollout.models.attention_math import indexer_select

    r, rope, heads = (32, 16, 4) if ctx.tiny else (512, 64, 16)
    requests = [(70, 1), (130, 1), (40, 6), (1, 1)] if ctx.tiny else [(70, 1), (1300, 1), (200, 33), (1, 1), (4000, 1)]
    ref = get_backend("torch_ref")
    results = {}
    for name in ("triton", "flashmla"):
        backend, why = backend_or_reason(name)
        if backend is None:
            results[name] = {"status": "unavailable", "why": why}
            continue
        cases = {}
        dtypes = (torch.bfloat16,) if name == "flashmla" else (torch.float32, torch.bfloat16)
        for dtype in dtypes:
            for topk in (None, 64):
                for elsewhere in (False, True):
                    for partial in (False, True):
                        key = f"{str(dtype)[6:]}/{'causal' if topk is None else f'dsa-{topk}'}/" \
                              f"{'cp-pages' if elsewhere else 'whole'}/{'partial' if partial else 'final'}"
                        try:
                            pool, batch, q, q_pe = attention_case(ctx, dtype, 64, r, rope, heads, requests, elsewhere, 0)
                            selected = None if topk is None else indexer_select(
                                torch.randn(batch.num_tokens, batch.max_seq_len,
                                            generator=torch.Generator().manual_seed(1)).to(ctx.device),
                                batch.causal(), topk)
                            scale = (r // 4 + rope) ** -0.5
                            want = ref.forward(0, q, q_pe, pool, batch, selected, scale, partial)
                            cases[key] = compare(backend.forward(0, q, q_pe, pool, batch, selected, scale, partial), want)
                        except Exception:  # noqa: BLE001 -- one case's failure is a result
                            cases[key] = {"error": traceback.format_exc(limit=6)}
        worst = {}
        for key, c in cases.items():
            d = key.split("/")[0]
            if "error" in c:
                worst.setdefault(d, {})["errors"] = worst.get(d, {}).get("errors", 0) + 1
                continue
            w = worst.setdefault(d, {"max_abs_out": 0.0, "max_abs_lse": 0.0})
            w["max_abs_out"] = max(w.get("max_abs_out", 0.0), c["max_abs_out"])
            w["max_abs_lse"] = max(w.get("max_abs_lse", 0.0), c["max_abs_lse"])
            w["all_clean"] = w.get("all_clean", True) and not c["nan_in_out"] and c["empty_rows_agree"]
        results[name] = {"status": "ok", "worst_per_dtype": worst, "cases": cases}
    try:
        results["flashmla_sparse_fp8"] = sparse_fp8_parity(ctx, requests, r, rope)
    except Exception:  # noqa: BLE001
        results["flashmla_sparse_fp8"] = {"error": traceback.format_exc(limit=6)}
    try:
        results["triton_indexer"] = indexer_parity(ctx, requests)
    except Exception:  # noqa: BLE001
        results["triton_indexer"] = {"error": traceback.format_exc(limit=6)}
    return results


def sparse_fp8_parity(ctx, requests, r: int, rope: int) -> dict:
    """DSA rows through FlashMLA's sparse fp8 kernel (64 heads) against torch_ref over the pool as
    the fp8 format holds it (dequantised): the kernel's error beyond the format's rounding."""
    torch = ctx.torch
    from splash_rollout.engine.attention import get_backend
    from splash_rollout.engine.attention.flashmla_backend import FlashMLABackend
    from splash_rollout.engine.attention.kv_format import pack_pages, unpack_fp8
    from splash_rollout.models.attention_math import indexer_select

    try:
        backend = FlashMLABackend(sparse_fp8=True)
    except ImportError as exc:
        return {"status": "unavailable", "why": str(exc)}
    out = {}
    for elsewhere in (False, True):
        pool, batch, q, q_pe = attention_case(ctx, torch.bfloat16, 64, r, rope, 64, requests, elsewhere, 5)
        selected = indexer_select(torch.randn(batch.num_tokens, batch.max_seq_len,
                                              generator=torch.Generator().manual_seed(6)).to(ctx.device),
                                  batch.causal(), 64 if ctx.tiny else 2048)
        got = backend.forward(0, q, q_pe, pool, batch, selected, 0.05)
        c, k_pe = unpack_fp8(pack_pages(pool.kv[0], r)[:, :, 0], r, rope)
        pool.kv[0] = torch.cat([c, k_pe.float()], -1).to(torch.bfloat16)
        out["cp-pages" if elsewhere else "whole"] = compare(got, get_backend("torch_ref").forward(
            0, q, q_pe, pool, batch, selected, 0.05))
    return out


def indexer_parity(ctx, requests) -> dict:
    """The Triton indexer-logits kernel against the executor's torch scores, per dtype, over a
    NaN-filled indexer cache: max abs error at stored positions."""
    torch = ctx.torch
    from splash_rollout.engine.attention.triton_backend import TritonBackend
    from splash_rollout.engine.executors.single import index_scores
    from splash_rollout.engine.forward_batch import ForwardBatch
    from splash_rollout.engine.kv_pool import KVPool, KVPoolSpec

    d, hi, page = (16, 4, 64) if ctx.tiny else (128, 64, 64)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(3)
        num_pages = sum(-(-s // page) for s, _ in requests) + 2
        pool = KVPool(KVPoolSpec(8, 8, (d,)), num_pages, page, dtype=dtype, device=ctx.device)
        pool.fill_(float("nan"))
        free = torch.randperm(num_pages, generator=g).tolist()
        items, slots = [], []
        for s, n in requests:
            pages = [free.pop() for _ in range(-(-s // page))]
            slots += [pages[pos // page] * page + pos % page for pos in range(s)]
            items.append((list(range(n)), s - n, n, pages, True))
        pool.write_index_k(0, torch.tensor(slots, device=ctx.device), torch.randn(len(slots), d, generator=g).to(ctx.device))
        batch = ForwardBatch.build(items, page_size=page, device=ctx.device)
        q = torch.randn(batch.num_tokens, hi, d, generator=g).to(ctx.device, dtype)
        w = torch.randn(batch.num_tokens, hi, generator=g).to(ctx.device)
        got = TritonBackend().index_scores(pool, 0, q, w, batch)
        want = index_scores(pool, 0, q, w, batch)
        stored = batch.key_stored().index_select(0, batch.row_seq)
        out[str(dtype)[6:]] = {"max_abs": float((got[stored] - want[stored]).abs().max()),
                               "max_rel": float(((got[stored] - want[stored]).abs() / want[stored].abs().clamp(min=1)).max())}
    return out


def part_kernel_bandwidth(ctx) -> dict:
    torch = ctx.torch
    r, rope, heads = (32, 16, 4) if ctx.tiny else (512, 64, 16)
    context = 64 if ctx.tiny else 2048
    sizes = (2, 4) if ctx.tiny else (64, 256)
    results = {}
    for b in sizes:
        pool, batch, q, q_pe = attention_case(ctx, torch.bfloat16, 64, r, rope, heads, [(context, 1)] * b, False, 2)
        kv_bytes = b * context * (r + rope) * 2
        row = {"kv_bytes": kv_bytes, "bound_s": kv_bytes / (ctx.args.hbm_gbps * 1e9)}
        variants = [(name, None) for name in BACKENDS] + [(f"triton(block_n={k})", k) for k in (32, 64)]
        for name, block_n in variants:
            if block_n is None:
                backend, why = backend_or_reason(name)
            else:
                try:
                    from splash_rollout.engine.attention.triton_backend import TritonBackend
                    backend, why = TritonBackend(block_n=block_n), None
                except Exception as exc:  # noqa: BLE001
                    backend, why = None, f"{type(exc).__name__}: {exc}"
            if backend is None:
                row[name] = {"status": "unavailable", "why": why}
                continue
            try:
                seconds = ctx.timed(lambda: backend.forward(0, q, q_pe, pool, batch, None, 0.1), 1 if ctx.tiny else 20)
                row[name] = {"seconds": seconds, "gb_per_s": kv_bytes / seconds / 1e9,
                             "times_bound": seconds / row["bound_s"]}
            except Exception:  # noqa: BLE001
                row[name] = {"error": traceback.format_exc(limit=6)}
        results[f"B={b},S={context}"] = row
    return results


def part_engine_cuda_vs_cpu(ctx) -> dict:
    from splash_rollout import EngineConfig, RolloutEngine, SamplingParams

    prompts = [[5, 6, 7] * 7, [9] * 3, list(range(3, 60))]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=4 if ctx.tiny else 16, ignore_eos=True)
    base = dict(model="glm5-nano", memory_budget_gib=0.05, page_size=64)

    def run(device, backend, dtype="float32"):
        with RolloutEngine(EngineConfig(device=device, attention_backend=backend, **base, dtype=dtype)) as eng:
            out = eng.generate(prompts, sampling)
        return [s.response_ids for s in out.samples], [s.response_logprobs for s in out.samples]

    want = {"float32": run("cpu", "torch")}
    results = {}
    for name in BACKENDS:
        backend, why = backend_or_reason(name)
        if backend is None:
            results[name] = {"status": "unavailable", "why": why}
            continue
        try:
            # FlashMLA reads bfloat16 only: it is compared with the torch backend on the device in bfloat16
            dtype = "bfloat16" if name == "flashmla" else "float32"
            if dtype not in want:
                want[dtype] = run(ctx.device, "torch", dtype)
            want_ids, want_lps = want[dtype]
            ids, lps = run(ctx.device, name, dtype)
            worst = max(abs(a - b) for x, y in zip(lps, want_lps) for a, b in zip(x, y))
            results[name] = {"same_tokens": ids == want_ids, "max_abs_logprob": worst,
                             "against": "cpu torch float32" if dtype == "float32" else "device torch bfloat16"}
        except Exception:  # noqa: BLE001
            results[name] = {"error": traceback.format_exc(limit=8)}
    return results


def part_speculation(ctx) -> dict:
    """Speculative decoding on the device: always / auto write exactly off's samples."""
    from splash_rollout import EngineConfig, RolloutEngine, SamplingParams

    prompts = [[5, 6, 7, 8] * 4, [9, 10] * 6, [3] * 12]
    new = 8 if ctx.tiny else 64
    calls = [SamplingParams(n=8, temperature=0.0, max_new_tokens=new, ignore_eos=True),
             SamplingParams(n=8, temperature=1.0, top_k=8, max_new_tokens=new, ignore_eos=True, seed=3)]
    results = {}
    for name in BACKENDS:
        backend, why = backend_or_reason(name)
        if backend is None or name == "flashmla":  # FlashMLA pages are bfloat16: reproducible numerics are float32
            results[name] = {"status": "unavailable", "why": why or "bfloat16 pages only"}
            continue
        # torch: reproducible numerics, where a verified row rounds like a decoded one; Triton
        # accumulates in float32 (fast numerics): the same tokens, logprobs to rounding
        numerics = "reproducible" if name == "torch" else "fast"
        try:
            per_arm = {"numerics": numerics}
            for arm in ("off", "always", "auto"):
                config = EngineConfig(model="glm5-nano", device=ctx.device, attention_backend=name, numerics=numerics,
                                      memory_budget_gib=0.05, page_size=64, speculation=arm)
                with RolloutEngine(config) as eng:
                    eng.generate(prompts, calls[0])  # the drafter's history for these prompts
                    t0 = time.time()
                    out = eng.generate(prompts, calls[1])
                    ctx.sync()
                    per_arm[arm] = {"seconds": time.time() - t0, "steps": out.metrics["perf/steps"],
                                    "acceptance_len": out.metrics["spec/acceptance_len"],
                                    "samples": [(s.response_ids, s.response_logprobs) for s in out.samples]}
            want = per_arm["off"].pop("samples")
            for arm in ("always", "auto"):
                got = per_arm[arm].pop("samples")
                per_arm[arm]["same_tokens"] = [g[0] for g in got] == [w[0] for w in want]
                per_arm[arm]["max_abs_logprob"] = max((abs(a - b) for g, w in zip(got, want)
                                                       for a, b in zip(g[1], w[1])), default=0.0)
            results[name] = per_arm
        except Exception:  # noqa: BLE001
            results[name] = {"error": traceback.format_exc(limit=8)}
    return results


def throughput_model(ctx):
    """DeepSeek-V2-Lite's attention dimensions (16 heads, no q LoRA, kv_lora_rank 512, rope 64, nope
    128, v 128, hidden 2048) with dense FFN layers; ``--tiny`` shrinks everything."""
    from splash_rollout.models.config import PRESETS

    if ctx.tiny:
        return PRESETS["deepseek-v3"].replace(
            name="v2-lite-attn-tiny", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, q_lora_rank=None,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128,
            moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
            topk_group=1, first_k_dense_replace=2, rope_scaling=None, max_position_embeddings=512)
    layers = ctx.args.layers
    return PRESETS["deepseek-v3"].replace(
        name="v2-lite-attn", vocab_size=102400, hidden_size=2048, num_layers=layers, num_heads=16, q_lora_rank=None,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=10944,
        moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, n_group=1,
        topk_group=1, first_k_dense_replace=layers, rope_scaling=None, max_position_embeddings=4096)


def throughput_plan(ctx):
    """(batch sizes, prompt length, short and long response lengths)."""
    return ((1, 4), 8, 2, 6) if ctx.tiny else ((1, 64, 256), 128, 8, 72)


def step_bound(ctx, config, param_bytes: int, b: int, mean_len: float) -> float:
    """Seconds one decode step needs at the HBM bound: every weight once, every row's KV once."""
    kv = b * mean_len * config.num_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * 2
    return (param_bytes + kv) / (ctx.args.hbm_gbps * 1e9)


def part_decode_throughput(ctx) -> dict:
    torch = ctx.torch
    from splash_rollout import EngineConfig, RolloutEngine, SamplingParams

    config = throughput_model(ctx)
    sizes, prompt_len, short, long = throughput_plan(ctx)
    param_bytes = None
    results = {"model": {"layers": config.num_layers, "hidden": config.hidden_size, "heads": config.num_heads,
                         "kv_lora_rank": config.kv_lora_rank, "dtype": "bfloat16"}}
    g = torch.Generator().manual_seed(0)
    for name in BACKENDS:
        backend, why = backend_or_reason(name)
        if backend is None:
            results[name] = {"status": "unavailable", "why": why}
            continue
        try:
            rows = {}
            with RolloutEngine(EngineConfig(model=config, device=ctx.device, dtype="bfloat16", attention_backend=name,
                                            page_size=64, max_num_seqs=max(sizes), max_num_batched_tokens=4096,
                                            num_pages=max(sizes) * -(-(prompt_len + long) // 64) + 8)) as eng:
                if param_bytes is None:
                    param_bytes = sum(p.numel() * p.element_size() for p in eng.model.parameters())
                for b in sizes:
                    prompts = [torch.randint(2, config.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(b)]
                    seconds = {}
                    for n in (short, short, long):  # the first run warms up (kernel compiles)
                        t0 = time.perf_counter()
                        eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True))
                        ctx.sync()
                        seconds[n] = time.perf_counter() - t0
                    step = (seconds[long] - seconds[short]) / (long - short)
                    bound = step_bound(ctx, config, param_bytes, b, prompt_len + (short + long) / 2)
                    rows[f"B={b}"] = {"decode_tokens_per_s": b / step, "step_s": step, "bound_step_s": bound,
                                      "times_bound": step / bound}
            results[name] = rows
        except Exception:  # noqa: BLE001
            results[name] = {"error": traceback.format_exc(limit=8)}
    results["param_bytes"] = param_bytes
    return results


KERNEL_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
"""The runtime / driver calls that launch one kernel (a graph replay is one ``cudaGraphLaunch``)."""


def profile_greedy(ctx, eng, prompts, tokens: int):
    """torch.profiler's per-op averages (``key_averages``) over one greedy call of ``tokens`` tokens."""
    torch = ctx.torch
    from splash_rollout import SamplingParams

    activities = [torch.profiler.ProfilerActivity.CPU]
    if ctx.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True))
        ctx.sync()
    return prof.key_averages()


def op_count(ops, *names: str) -> int:
    """Calls of the named ops / runtime functions in ``profile_greedy``'s averages."""
    return sum(e.count for e in ops if e.key in names)


def _profile_decode(ctx, eng, prompts, tokens: int) -> dict:
    """Kernel launches, graph launches and host syncs per decode step of one greedy call (the call's
    first step is the prefill; its launches are included, a bound)."""
    ops = profile_greedy(ctx, eng, prompts, tokens)
    steps = max(tokens - 1, 1)
    return {"kernel_launches_per_step": op_count(ops, *KERNEL_LAUNCHES) / steps,
            "graph_launches_per_step": op_count(ops, "cudaGraphLaunch") / steps,
            "stream_syncs_per_step": op_count(ops, "cudaStreamSynchronize", "cudaDeviceSynchronize") / steps,
            "memcpy_syncs_per_step": op_count(ops, "cudaMemcpy") / steps}


def _graph_engine(ctx, model, graphs: bool, sizes, prompt_len: int, long: int, backend: str, dtype: str):
    from splash_rollout import EngineConfig, RolloutEngine

    return RolloutEngine(EngineConfig(
        model=model, device=ctx.device, dtype=dtype, attention_backend=backend, page_size=64, max_num_seqs=max(sizes),
        max_num_batched_tokens=4096, num_pages=max(sizes) * -(-(prompt_len + long) // 64) + 8, speculation="off",
        max_model_len=-(-(prompt_len + long + 64) // 64) * 64, cuda_graphs="on" if graphs else "off"))


def _sync_debug_forward(ctx, engine) -> dict:
    """Wrap the engine's forward: padded (graphed) decode forwards run under sync-debug "error"."""
    torch = ctx.torch
    seen = {"graphed_forwards": 0, "error": None}
    forward = engine._forward

    def guarded(batch, order):
        if batch.num_real is None or ctx.device != "cuda":
            return forward(batch, order)
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = forward(batch, order)
            seen["graphed_forwards"] += 1
            return out
        except RuntimeError as exc:
            seen["error"] = seen["error"] or f"{type(exc).__name__}: {str(exc)[:300]}"
            raise
        finally:
            torch.cuda.set_sync_debug_mode("default")

    engine._forward = guarded
    return seen


def part_cuda_graph(ctx) -> dict:
    torch = ctx.torch
    from splash_rollout import EngineConfig, RolloutEngine, SamplingParams
    from splash_rollout.engine.host_syncs import HostSyncs

    config = throughput_model(ctx)
    sizes, prompt_len, short, long = throughput_plan(ctx)
    backend = "triton"
    on_gpu = ctx.device == "cuda"  # on the CPU (a check of the script) both arms run eagerly
    g = torch.Generator().manual_seed(0)
    results = {"backend": backend, "dtype": "bfloat16", "rounds": 2, "graphs_possible": on_gpu}
    engines = {arm: _graph_engine(ctx, config, arm == "graphed" and on_gpu, sizes, prompt_len, long, backend,
                                  "bfloat16" if on_gpu else "float32")
               for arm in ("eager", "graphed")}
    try:
        graphed = engines["graphed"].local_engine
        results["graphs_captured"] = len(graphed.graphs.graphs) if graphed.graphs else 0
        results["graph_bytes"] = graphed.graphs.bytes if graphed.graphs else 0
        results["graph_reserve_bytes"] = graphed.settings.graph_reserve_bytes
        param_bytes = sum(p.numel() * p.element_size() for p in engines["eager"].model.parameters())
        sync_debug = _sync_debug_forward(ctx, graphed)
        for b in sizes:
            prompts = [torch.randint(2, config.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(b)]
            row = {arm: {"step_s": [], "tokens": None} for arm in engines}
            for arm in ("eager", "graphed", "eager", "graphed"):  # alternated: the machine's drift hits both
                eng = engines[arm]
                seconds, out = {}, None
                for n in (short, short, long):  # the first run warms up
                    t0 = time.perf_counter()
                    out = eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True))
                    ctx.sync()
                    seconds[n] = time.perf_counter() - t0
                row[arm]["step_s"].append((seconds[long] - seconds[short]) / (long - short))
                row[arm]["tokens"] = [s.response_ids for s in out.samples]
            bound = step_bound(ctx, config, param_bytes, b, prompt_len + (short + long) / 2)
            for arm in engines:
                step = sorted(row[arm]["step_s"])[0]
                row[arm].update(best_step_s=step, times_bound=step / bound, tokens_per_s=b / step,
                                **_profile_decode(ctx, engines[arm], prompts, 6))
            same = [x == y for x, y in zip(row["eager"].pop("tokens"), row["graphed"].pop("tokens"))]
            counters: list[HostSyncs] = []
            engine_step = graphed._step

            def counted(*args, **kwargs):
                counters.append(HostSyncs())
                with counters[-1]:
                    return engine_step(*args, **kwargs)

            graphed._step = counted
            engines["graphed"].generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
            graphed._step = engine_step
            decode = counters[1:]  # the first step is the prefill
            row.update(bound_step_s=bound, graphed_over_eager=row["eager"]["best_step_s"] / row["graphed"]["best_step_s"],
                       same_tokens_fraction=sum(same) / len(same),
                       host_syncs_per_decode_step=[c.count for c in decode],
                       host_sync_sites=dict(sum((c.sites for c in decode), collections.Counter())))
            results[f"B={b}"] = row
        results["sync_debug"] = sync_debug
        results["graph_replays"] = graphed.graphs.replays if graphed.graphs else 0
        results["graphs_disabled"] = graphed.graphs.disabled if graphed.graphs else "no graphs"
    finally:
        for eng in engines.values():
            eng.shutdown()
    # the tokens, one by one, in float32 on glm5-nano (DSA + MoE: the Triton expert kernel in the graph)
    prompts = [[5, 6, 7] * 7, [9] * 3, list(range(3, 60))]
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=24, ignore_eos=True)
    runs = {}
    for arm in ("eager", "graphed"):
        with RolloutEngine(EngineConfig(model="glm5-nano", device=ctx.device, attention_backend=backend, page_size=64,
                                        memory_budget_gib=0.05, speculation="off", max_model_len=512,
                                        cuda_graphs="on" if arm == "graphed" and on_gpu else "off")) as eng:
            out = eng.generate(prompts, greedy)
            runs[arm] = [(s.response_ids, s.response_logprobs) for s in out.samples]
    results["glm5_nano_float32"] = {
        "same_tokens": [r[0] for r in runs["eager"]] == [r[0] for r in runs["graphed"]],
        "max_abs_logprob": max(abs(a - b) for (_, x), (_, y) in zip(runs["eager"], runs["graphed"]) for a, b in zip(x, y))}
    return results


def part_sharded_load(ctx) -> dict:
    import tempfile

    torch = ctx.torch
    from benchmarks.memory_probe import AnonPeak
    from benchmarks.sharded_load import PROMPTS, nano_config
    from splash_rollout import EngineConfig, RolloutEngine, SamplingParams
    from splash_rollout.models.model import MLAForCausalLM
    from splash_rollout.models.weights import save_checkpoint

    config = nano_config(8, 96) if ctx.tiny else nano_config(64, 1536)
    with tempfile.TemporaryDirectory() as folder:
        save_checkpoint(MLAForCausalLM.from_config(config, seed=0, dtype=torch.bfloat16), folder)
        on_disk = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        if ctx.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            gpu_before = torch.cuda.memory_allocated()
        probe = AnonPeak().start()
        t0 = time.perf_counter()
        eng = RolloutEngine(EngineConfig(model=folder, device=ctx.device, dtype="bfloat16", num_pages=64, page_size=64,
                                         speculation="off", cuda_graphs="off"))
        load_s = time.perf_counter() - t0
        peaks = probe.stop()
        try:
            stats = eng.memory_stats()[0]
            held = stats["weights"] + stats["kv_pool"]
            out = {"checkpoint_bytes": on_disk, "load_s": load_s, "weights_bytes": stats["weights"],
                   "kv_pool_bytes": stats["kv_pool"],
                   "host_peak_anon_growth_over_weights": (peaks.get(os.getpid(), probe.baseline) - probe.baseline)
                   / stats["weights"]}
            if ctx.device == "cuda":
                out["gpu_peak_over_held"] = (torch.cuda.max_memory_allocated() - gpu_before) / held
            batch = eng.generate(PROMPTS, SamplingParams(n=2, temperature=0.0, max_new_tokens=8, ignore_eos=True))
            out["generated_tokens"] = sum(len(s.response_ids) for s in batch.samples)
        finally:
            eng.shutdown()
    return out


def part_transformers_peer(ctx) -> dict:
    torch = ctx.torch
    try:
        import transformers
    except Exception as exc:  # noqa: BLE001
        return {"status": "unavailable", "why": f"transformers not importable: {type(exc).__name__}: {exc}"}
    config = throughput_model(ctx)
    sizes, prompt_len, short, long = throughput_plan(ctx)
    hf_cfg = transformers.DeepseekV3Config(**config.to_hf_dict())
    with torch.device(ctx.device):
        model = transformers.DeepseekV3ForCausalLM(hf_cfg).to(torch.bfloat16).eval()
    results = {"transformers": transformers.__version__, "attn_implementation": hf_cfg._attn_implementation}
    g = torch.Generator().manual_seed(0)
    for b in sizes:
        ids = torch.randint(2, config.vocab_size, (b, prompt_len), generator=g).to(ctx.device)
        seconds = {}
        for n in (short, short, long):
            t0 = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)
            ctx.sync()
            seconds[n] = time.perf_counter() - t0
        step = (seconds[long] - seconds[short]) / (long - short)
        results[f"B={b}"] = {"decode_tokens_per_s": b / step, "step_s": step}
    return results


PART_FUNCS = {"env": part_env, "kernel_parity": part_kernel_parity, "kernel_bandwidth": part_kernel_bandwidth,
              "engine_cuda_vs_cpu": part_engine_cuda_vs_cpu, "speculation": part_speculation,
              "cuda_graph": part_cuda_graph, "sharded_load": part_sharded_load,
              "decode_throughput": part_decode_throughput,
              "transformers_peer": part_transformers_peer}


def summary(report: dict) -> list[str]:
    """Human lines: status per part, worst parity, tokens/s per backend and the ratio to transformers."""
    lines = []
    parts = report["parts"]
    for name, part in parts.items():
        lines.append(f"{name}: {part['status']} ({part.get('seconds', 0):.1f} s)")
    parity = parts.get("kernel_parity", {}).get("result", {})
    for backend, res in parity.items():
        for dtype, w in res.get("worst_per_dtype", {}).items():
            lines.append(f"  parity {backend} {dtype}: {w}")
    for case, w in parity.get("flashmla_sparse_fp8", {}).items():
        lines.append(f"  parity flashmla sparse fp8 {case}: {w}")
    for dtype, w in parity.get("triton_indexer", {}).items():
        lines.append(f"  parity triton indexer {dtype}: {w}")
    graphs = parts.get("cuda_graph", {}).get("result", {})
    for key, row in graphs.items():
        if key.startswith("B=") and isinstance(row, dict):
            lines.append(f"  cuda_graph {key}: graphed {row['graphed']['times_bound']:.1f}x the HBM bound, "
                         f"{row['graphed_over_eager']:.1f}x eager; launches/step {row['graphed']['kernel_launches_per_step']:.0f} "
                         f"vs {row['eager']['kernel_launches_per_step']:.0f}; tokens equal {row['same_tokens_fraction']:.2f}")
    if "sync_debug" in graphs:
        lines.append(f"  cuda_graph sync-debug: {graphs['sync_debug']}; disabled: {graphs.get('graphs_disabled')}")
    if "glm5_nano_float32" in graphs:
        lines.append(f"  cuda_graph glm5-nano float32: {graphs['glm5_nano_float32']}")
    load = parts.get("sharded_load", {}).get("result", {})
    if load:
        lines.append(f"  sharded_load: {load}")
    peer = parts.get("transformers_peer", {}).get("result", {})
    thr = parts.get("decode_throughput", {}).get("result", {})
    for backend in BACKENDS:
        rows = thr.get(backend, {})
        for key, row in rows.items() if isinstance(rows, dict) else []:
            if isinstance(row, dict) and "decode_tokens_per_s" in row:
                ratio = ""
                if isinstance(peer.get(key), dict):
                    ratio = f", {row['decode_tokens_per_s'] / peer[key]['decode_tokens_per_s']:.1f}x transformers"
                lines.append(f"  {backend} {key}: {row['decode_tokens_per_s']:.0f} tok/s, "
                             f"{row['times_bound']:.1f}x the HBM bound{ratio}")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "device_check.json")
    start = time.time()
    report = {"args": vars(args), "parts": {}}
    ctx = None
    for name in args.parts.split(","):
        part = {"status": "skipped", "why": "time budget spent"} if time.time() - start > args.budget_s else None
        if part is None:
            t0 = time.time()
            try:
                ctx = ctx or Ctx(args)
                part = {"status": "ok", "result": PART_FUNCS[name](ctx)}
            except Exception:  # noqa: BLE001 -- every part runs; its traceback is the result
                part = {"status": "error", "traceback": traceback.format_exc()}
            part["seconds"] = time.time() - t0
        report["parts"][name] = part
        report["elapsed_s"] = time.time() - start
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)
    print("\n".join(summary(report)))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
