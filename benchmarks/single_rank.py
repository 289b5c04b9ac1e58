"""Single-rank throughput: this engine vs transformers ``generate`` on a draining batch.

Workload: 32 prompts (16-64 tokens) on ``glm5-nano`` (random init, float32, CPU), response lengths
heavy-tailed in [16, 512] (Pareto, the longest forced to 512), ``ignore_eos`` with a per-prompt
``max_new_tokens``. The engine runs them with continuous batching (finished rows leave the batch);
transformers runs one static batch of the same prompts (left padded) for the longest length, which
is what ``generate`` can do with per-prompt lengths. Both count only the requested tokens. Same
weights: the engine's random init is saved as a HF checkpoint and loaded by
``GlmMoeDsaForCausalLM``. Greedy on both sides. One run each; writes
``{"engine_tokens_per_s", "transformers_tokens_per_s", "ratio", ...}``. Denormals are flushed to zero
for both (the engine's CPU default; without it softmax tails make both sides ~7x slower).

    python benchmarks/single_rank.py --json OUT.json
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
from splash_rollout.models.weights import save_checkpoint  # noqa: E402


def workload(num_prompts: int, max_len: int, seed: int, vocab: int):
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(16, 65, num_prompts)
    prompts = [rng.integers(2, vocab, n).tolist() for n in prompt_lens]
    resp = np.clip((16 * (1 + rng.pareto(1.2, num_prompts))).astype(int), 16, max_len)
    resp[int(rng.integers(num_prompts))] = max_len
    return prompts, [int(r) for r in resp]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="output JSON path")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-response", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)

    engine = RolloutEngine(EngineConfig(model="glm5-nano", dtype="float32", seed=args.seed, page_size=16,
                                        max_num_batched_tokens=args.max_num_batched_tokens,
                                        num_pages=args.num_prompts * (64 + args.max_response) // 16 + args.num_prompts))
    prompts, lens = workload(args.num_prompts, args.max_response, args.seed, engine.model_config.vocab_size)
    total = sum(lens)
    sampling = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in lens]

    engine.generate([p[:4] for p in prompts[:2]], SamplingParams(temperature=0.0, max_new_tokens=2))  # warm-up
    t0 = time.perf_counter()
    out = engine.generate(prompts, sampling)
    t_engine = time.perf_counter() - t0
    assert sum(len(s.response_ids) for s in out.samples) == total
    steps = out.metrics["perf/steps"]

    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(engine.model, tmp)
        hf = transformers.GlmMoeDsaForCausalLM.from_pretrained(tmp, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    engine.shutdown()
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        hf.generate(ids[:2, -4:], attention_mask=mask[:2, -4:], max_new_tokens=2, do_sample=False,
                    eos_token_id=None, pad_token_id=0)  # warm-up
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=mask, max_new_tokens=max(lens), do_sample=False,
                    eos_token_id=None, pad_token_id=0)
        t_hf = time.perf_counter() - t0

    result = {
        "engine_tokens_per_s": total / t_engine,
        "transformers_tokens_per_s": total / t_hf,
        "ratio": (total / t_engine) / (total / t_hf),
        "tokens": total,
        "engine_s": t_engine,
        "transformers_s": t_hf,
        "engine_steps": steps,
        "response_lens": lens,
        "num_prompts": args.num_prompts,
        "torch_threads": torch.get_num_threads(),
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "response_lens"}, indent=2))


if __name__ == "__main__":
    main()
