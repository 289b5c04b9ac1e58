"""Two paths of the engine alternated in one process (fused RMSNorm/RoPE on and off), so the
machine's drift over minutes falls on both: python ab_inproc.py CKPT PROMPTS PROMPT_LEN NEW DTYPE [REPS]."""
import sys, time, torch, numpy as np, os
import splash_rollout.models.norm as _n, splash_rollout.models.rope as _r
from splash_rollout import EngineConfig, RolloutEngine, SamplingParams
ckpt, P, L, NEW, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
reps = int(sys.argv[6]) if len(sys.argv) > 6 else 4
torch.set_num_threads(2)
rng = np.random.default_rng(0)
prompts = [rng.integers(2, 4096, L).tolist() for _ in range(P)]
eng = RolloutEngine(EngineConfig(model=ckpt, attention_backend="cpu", dtype=dtype, num_pages=P*(L+NEW)//16+P+64, max_num_batched_tokens=2048, max_num_seqs=256))
eng.generate(prompts[:4], SamplingParams(n=1, temperature=1.0, max_new_tokens=4, ignore_eos=True))
on = (_n.rms_norm, _r.rope); off = (lambda *a: None, lambda *a: None)
res = {"on": [], "off": []}
for i in range(reps):
    for name in (("on", "off") if i % 2 == 0 else ("off", "on")):
        _n.rms_norm, _r.rope = on if name == "on" else off
        t = time.perf_counter(); b = eng.generate(prompts, SamplingParams(n=1, temperature=1.0, max_new_tokens=NEW, ignore_eos=True, seed=1)); dt = time.perf_counter() - t
        res[name].append(sum(len(s.response_ids) for s in b.samples) / dt)
for k, v in res.items(): print(k, " ".join(f"{x:.1f}" for x in v), "median", f"{np.median(v):.1f}")
eng.shutdown()
