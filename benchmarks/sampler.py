"""Sampler speed: the batched counter-based sampler vs the per-row loop it replaced, side by side.

The baseline is a copy of the old sampler (a Python loop over rows, one ``torch.Generator`` per
request, a sort per row when top-p is on), kept here only as the reference point. Both run on the
same logits, alternating call by call so load from other processes hits both alike.

Settings: ``plain`` (temperature 1, no truncation: what GRPO rollouts usually run) and ``truncated``
(temperature 0.8, top-k 50, top-p 0.9: every row sorted). Rows R in {16, 256, 1024}, vocab
V in {512, 32768}.

Prints (and with ``--json`` writes) ``{"cases": [{"setting", "rows", "vocab", "loop_ms", "batched_ms",
"speedup"}, ...], "device", "threads", "reps"}``; ms are medians per call.

    python benchmarks/sampler.py --json /tmp/sampler.json
    python benchmarks/sampler.py --quick           # smallest shapes only, a few seconds
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from splash_rollout.engine.request import SamplingSpec  # noqa: E402
from splash_rollout.engine.sampler import SamplingBatch, sample  # noqa: E402


# ---- the baseline: the per-row loop sampler this package used before ---------------------------
def _loop_truncate(probs: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    vocab = probs.shape[-1]
    if 0 < spec.top_k < vocab:
        kth = torch.topk(probs, spec.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if spec.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_p, 0) - sorted_p
        keep_sorted = mass_before < spec.top_p * sorted_p.sum()
        keep_sorted[0] = True
        keep = torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    if spec.min_p > 0.0:
        probs = torch.where(probs >= spec.min_p * probs.max(), probs, torch.zeros_like(probs))
    return probs


def loop_sample(logits: torch.Tensor, specs: Sequence[SamplingSpec],
                generators: Sequence[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    temps = torch.tensor([s.temperature if s.temperature > 0 else 1.0 for s in specs], dtype=torch.float32)
    logprobs_all = torch.log_softmax(logits / temps[:, None], dim=-1)
    tokens = torch.argmax(logits, dim=-1)
    for i in range(logits.shape[0]):
        spec = specs[i]
        if spec.greedy:
            continue
        probs = _loop_truncate(logprobs_all[i].exp(), spec)
        cdf = torch.cumsum(probs, 0)
        u = torch.rand((), generator=generators[i], dtype=torch.float64).item() * cdf[-1].item()
        tok = int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype), right=True).item())
        tok = min(tok, probs.shape[0] - 1)
        while probs[tok] <= 0:
            tok -= 1
        tokens[i] = tok
    return tokens, logprobs_all.gather(1, tokens[:, None]).squeeze(1)


# ---- measurement ---------------------------------------------------------------------------------
SETTINGS = {"plain": dict(temperature=1.0), "truncated": dict(temperature=0.8, top_k=50, top_p=0.9)}


def _time_ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


def run_case(setting: str, rows: int, vocab: int, reps: int) -> dict:
    gen = torch.Generator().manual_seed(rows * 7 + vocab)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    specs = [SamplingSpec(seed=1000 + i, **SETTINGS[setting]) for i in range(rows)]
    generators = [torch.Generator().manual_seed(s.seed) for s in specs]
    draws = [5] * rows

    def batched():  # what a step does: build the per-row tensors, then sample
        return sample(logits, SamplingBatch.make(specs, draws, logits.device))

    loop_sample(logits, specs, generators), batched()  # warm up
    loop_ms, batched_ms = [], []
    for _ in range(reps):
        loop_ms.append(_time_ms(lambda: loop_sample(logits, specs, generators)))
        batched_ms.append(_time_ms(batched))
    loop, new = statistics.median(loop_ms), statistics.median(batched_ms)
    return {"setting": setting, "rows": rows, "vocab": vocab, "loop_ms": round(loop, 3),
            "batched_ms": round(new, 3), "speedup": round(loop / new, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="R=16 and 256 at V=512 only")
    args = ap.parse_args()
    shapes = [(r, v) for v in (512, 32768) for r in (16, 256, 1024)]
    if args.quick:
        shapes = [(16, 512), (256, 512)]
    cases = [run_case(s, r, v, args.reps) for s in SETTINGS for r, v in shapes]
    out = {"cases": cases, "device": "cpu", "threads": torch.get_num_threads(), "reps": args.reps}
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
