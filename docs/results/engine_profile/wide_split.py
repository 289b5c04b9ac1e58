"""Time the wide workload's attention, routed experts, per-head products and linears, prefill and decode
apart (wrappers around the engine's functions; nested calls overlap: the torch expert loop's linears
count under both). Usage: DT=float32 python wide_split.py (needs RUN.py: one RolloutEngine.generate of
256 prompts x 128 tokens, 64 new, as benchmarks/peer_engines.py's wide workload)."""
import sys, time, torch, numpy as np, collections, os
dtype = os.environ.get("DT", "float32")
sys.argv = ["x", os.environ.get("CKPT", "ckpt"), "256", "128", "64", "1", dtype, "2048", "cpu"]
from splash_rollout.engine.attention import cpu_paged
import splash_rollout.models.numerics as num, splash_rollout.models.moe as moe, splash_rollout.engine.projections as proj
import splash_rollout.engine.parallel_mlp as pm
T = collections.Counter(); C = collections.Counter()
def timed(key_fn, f):
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); key = key_fn(a); T[key] += time.perf_counter() - t; C[key] += 1; return r
    return g
phase = lambda n: "pre" if n > 256 else "dec"
orig = cpu_paged.CpuPagedBackend.forward
cpu_paged.CpuPagedBackend.forward = timed(lambda a: "attn/" + phase(a[2].shape[0]), orig)
moe.run_experts = timed(lambda a: "experts/" + phase(a[0].shape[0]), moe.run_experts)
pm.run_experts = moe.run_experts
lin = timed(lambda a: "linear/" + phase(a[0].shape[0]), num.linear)
for m in (num, proj, moe, pm): m.linear = lin
import splash_rollout.models.mla as mla
hm = timed(lambda a: "head_matmul/" + phase(a[0].shape[0]), num.head_matmul)
proj.head_matmul = hm; mla.head_matmul = hm
exec(open(os.environ.get("RUN", "RUN.py")).read())
for k in sorted(T): print(k, f"{T[k]:.2f}s {C[k]} calls {T[k]/C[k]*1e6:.0f}us/call")
