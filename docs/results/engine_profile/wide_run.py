"""The peer benchmark's wide workload in one process, for a profiler: python wide_run.py CKPT WORLD [NEW] [PROMPTS]
(CKPT: the checkpoint benchmarks/peer_engines.py builds; WORLD 1: T = 1, 2: T = 2 DP-attention).
One untimed warm-up, then one timed generate of PROMPTS x 128-token prompts, NEW tokens each, float32."""
import sys
import time

import numpy as np
import torch

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams

ckpt, world = sys.argv[1], int(sys.argv[2])
new = int(sys.argv[3]) if len(sys.argv) > 3 else 64
count = int(sys.argv[4]) if len(sys.argv) > 4 else 256
length = 128
torch.set_num_threads(2)
rng = np.random.default_rng(0)
prompts = [rng.integers(2, 4096, length).tolist() for _ in range(count)]
engine = RolloutEngine(EngineConfig(model=ckpt, dtype="float32", num_pages=count * (length + new) // 16 + count + 64,
                                    page_size=16, max_num_batched_tokens=2048, max_num_seqs=256, world_size=world,
                                    layout="dp"))
engine.generate([p[:16] for p in prompts[:4]], SamplingParams(n=1, temperature=1.0, max_new_tokens=4, ignore_eos=True,
                                                              seed=2))
start = time.perf_counter()
batch = engine.generate(prompts, SamplingParams(n=1, temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=1))
wall = time.perf_counter() - start
print(f"T={world} tok/s {sum(len(s.response_ids) for s in batch.samples) / wall:.1f} wall {wall:.2f} "
      f"steps {batch.metrics['perf/steps']:.0f}")
engine.shutdown()
