"""What reproducible numerics cost and buy: rollout speed and engine-vs-trainer logprob gap, fast vs
reproducible, side by side in one run.

Workload: the GRPO recipe's rollout (arithmetic-chain prompts, n samples each, temperature 1,
``max_new_tokens`` as the recipe) on ``glm5-nano`` over T spawned ranks, one engine per mode built
once, the modes alternating for ``--rounds`` rounds (so load from other processes hits both alike).
Weights: ``--weights`` (a recipe run's ``sft_policy.pt``: a trained model, where float32's
shape-dependent rounding shows) or the seeded random init. After each call the trainer side -- the
same weights, whole padded sequences, in this process under the same mode -- scores the sampled
tokens, and the largest |engine - trainer| logprob is kept.

Writes ``{"tokens_per_s": {"fast", "reproducible"}, "slowdown", "logprob_diff_max": {...},
"tokens_over_1e-5": {...}, "rounds": [...], "workload": {...}}``.

    python benchmarks/numerics_cost.py --weights outputs/<run>/sft_policy.pt --json docs/results/numerics_cost.json
    python benchmarks/numerics_cost.py --quick --json /tmp/numerics.json     # smoke test, < 1 min
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from splash_rollout.recipes.grpo.data import ChainTaskConfig, make_dataset  # noqa: E402
from splash_rollout.recipes.grpo.loss import token_logprobs  # noqa: E402
from splash_rollout.recipes.grpo.trainer import collate  # noqa: E402
from splash_rollout import EngineConfig, RolloutEngine, SamplingParams  # noqa: E402
from splash_rollout.models.config import resolve_model  # noqa: E402
from splash_rollout.models.model import MLAForCausalLM  # noqa: E402
from splash_rollout.models.numerics import NUMERICS_MODES, numerics  # noqa: E402
from splash_rollout.models.tokenizer import load_tokenizer  # noqa: E402

def trainer_gap(model: MLAForCausalLM, batch, mode: str, micro_batch: int = 32) -> tuple[float, int]:
    """(max |engine - trainer| logprob, tokens over 1e-5): the trainer scores the samples in padded
    micro-batches of ``micro_batch`` sorted by length, as the recipe does."""
    samples = sorted(batch.samples, key=lambda s: len(s.response_ids))
    worst, over = 0.0, 0
    with numerics(mode), torch.no_grad():
        for k in range(0, len(samples), micro_batch):
            chunk = samples[k:k + micro_batch]
            mb = collate([s.prompt_ids for s in chunk], [s.response_ids for s in chunk], pad_id=0,
                         per_token={"rollout": [s.response_logprobs for s in chunk]})
            mine = token_logprobs(model(mb.input_ids, mb.attention_mask)[:, :-1], mb.targets)
            diff = (mine - mb.extras["rollout"])[mb.loss_mask.bool()].abs()
            worst, over = max(worst, float(diff.max())), over + int((diff > 1e-5).sum())
    return worst, over


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", help="state dict (.pt) to load, e.g. a recipe run's sft_policy.pt")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--layout", default="dp")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=112)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="4 prompts x 2, 24 tokens, 1 round")
    parser.add_argument("--json", default="numerics_cost.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.n, args.max_new_tokens, args.rounds = 4, 2, 24, 1
    cfg = resolve_model("glm5-nano")
    model = MLAForCausalLM.from_config(cfg, seed=0)
    if args.weights:
        model.load_state_dict(torch.load(args.weights, map_location="cpu"))
    model.eval()
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    tokenizer = load_tokenizer("glm5-nano")
    rows = make_dataset(args.prompts * args.rounds, 2, ChainTaskConfig())[:]
    prompts = [tokenizer.encode(p) for p in rows["prompt"]]
    engines = {}
    for mode in NUMERICS_MODES:
        engines[mode] = RolloutEngine(EngineConfig(model="glm5-nano", world_size=args.world_size, layout=args.layout,
                                                   page_size=16, max_num_batched_tokens=2048, numerics=mode))
        engines[mode].update_weights(weights, version=1)
        engines[mode].generate(prompts[:2], SamplingParams(max_new_tokens=4, seed=0))  # warm-up
    records = []
    try:
        for r in range(args.rounds):
            chunk = prompts[r * args.prompts:(r + 1) * args.prompts]
            params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=100 + r,
                                    stop_token_ids=tuple(tokenizer.eos_token_ids))
            for mode in NUMERICS_MODES:
                start = time.perf_counter()
                batch = engines[mode].generate(chunk, params)
                wall = time.perf_counter() - start
                tokens = sum(len(s.response_ids) for s in batch.samples)
                worst, over = trainer_gap(model, batch, mode)
                records.append({"round": r, "numerics": mode, "wall_s": wall, "tokens": tokens,
                                "tokens_per_s": tokens / wall, "logprob_diff_max": worst, "tokens_over_1e-5": over})
                print(f"round {r} {mode:12s} {tokens / wall:7.1f} tok/s  max |engine - trainer| {worst:.2e}"
                      f"  ({over} tokens > 1e-5)", file=sys.stderr)
    finally:
        for engine in engines.values():
            engine.shutdown()
    speed = {m: statistics.median(x["tokens_per_s"] for x in records if x["numerics"] == m) for m in NUMERICS_MODES}
    out = {"tokens_per_s": speed, "slowdown": speed["fast"] / speed["reproducible"],
           "logprob_diff_max": {m: max(x["logprob_diff_max"] for x in records if x["numerics"] == m) for m in NUMERICS_MODES},
           "tokens_over_1e-5": {m: sum(x["tokens_over_1e-5"] for x in records if x["numerics"] == m) for m in NUMERICS_MODES},
           "rounds": records,
           "workload": {"weights": args.weights or "glm5-nano seed 0", "world_size": args.world_size,
                        "layout": args.layout, "prompts": args.prompts, "n": args.n,
                        "max_new_tokens": args.max_new_tokens, "torch_threads": torch.get_num_threads()}}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps({k: out[k] for k in ("tokens_per_s", "slowdown", "logprob_diff_max", "tokens_over_1e-5")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
