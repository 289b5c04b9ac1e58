"""cProfile of T = 1's timed wide call, top functions by self time:
python wide_cprofile.py CKPT [DTYPE] [TOP]  (CKPT: the checkpoint benchmarks/peer_engines.py builds).
The peer benchmark's wide workload in one process (256 x 128-token prompts, 64 new tokens each,
2 threads, max_num_batched_tokens 2,048) after its untimed warm-up; prints the wall, the steps, the
per-step time outside the products and attention kernels (wall minus their self time), and the top
functions by self time (the calling thread's waits included)."""
import cProfile
import pstats
import sys
import time

import numpy as np
import torch

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams

ckpt = sys.argv[1]
dtype = sys.argv[2] if len(sys.argv) > 2 else "float32"
top = int(sys.argv[3]) if len(sys.argv) > 3 else 20
torch.set_num_threads(2)
rng = np.random.default_rng(0)
prompts = [rng.integers(2, 4096, 128).tolist() for _ in range(256)]
engine = RolloutEngine(EngineConfig(model=ckpt, dtype=dtype, num_pages=3392, page_size=16, max_num_batched_tokens=2048,
                                    max_num_seqs=256))
engine.generate([p[:16] for p in prompts[:4]], SamplingParams(n=1, temperature=1.0, max_new_tokens=4, ignore_eos=True,
                                                              seed=2))
profile = cProfile.Profile()
start = time.perf_counter()
profile.enable()
batch = engine.generate(prompts, SamplingParams(n=1, temperature=1.0, max_new_tokens=64, ignore_eos=True, seed=1))
profile.disable()
wall = time.perf_counter() - start
engine.shutdown()
steps = int(batch.metrics["perf/steps"])
stats = pstats.Stats(profile)
self_time = {}
for (path, _, name), (_, _, tottime, _, _) in stats.stats.items():
    key = name if path == "~" else f"{path.rsplit('/', 1)[-1]}:{name}"
    self_time[key] = self_time.get(key, 0.0) + tottime
kernels = ("torch._C._nn.linear>", "mkldnn._linear_pointwise>", "scaled_dot_product_attention>", "torch.bmm>",
           "cpu_paged.py:forward", "routed_experts.py:routed_experts", "expanded_attention.py:expanded_attention")
in_kernels = sum(t for k, t in self_time.items() if any(k.endswith(name) for name in kernels))
print(f"{dtype} T=1 wide: {sum(len(s.response_ids) for s in batch.samples) / wall:.1f} tok/s (under cProfile), "
      f"wall {wall:.2f} s, {steps} steps; outside the products and attention kernels "
      f"{(wall - in_kernels) / steps * 1e3:.1f} ms a step (Python, scheduling, sampling, element-wise ops)")
for name, seconds in sorted(self_time.items(), key=lambda kv: -kv[1])[:top]:
    print(f"  {seconds:7.3f} s  {name}")
