"""Held-out accuracy of a GRPO run's policies, compared prompt by prompt.

A run's ``eval/accuracy`` curve tells whether accuracy rose; with a few hundred prompts a rise of a
few points is within the spread of two independent samples. The policies of one run answer the
*same* held-out prompts, so the fair test is a paired one: count the prompts the later policy gets
right and the earlier one wrong (gained) and the reverse (lost), and give McNemar's exact two-sided
p-value for "neither policy is better".

Reads the run directory a recipe wrote (``.hydra/config.yaml``, ``sft_policy.pt``,
``checkpoints/step_*/policy.pt``), rebuilds its eval split and reward exactly as the run did, and
decodes greedily on one rank (reproducible numerics: the accuracies equal the run's own
``eval/accuracy`` at those steps). The reward module must be importable as in the run (PYTHONPATH).

    PYTHONPATH=<dir of the reward module> python scripts/paired_eval.py <run dir> --json paired.json
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import numpy as np
import torch
from omegaconf import OmegaConf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from splash_rollout.recipes.grpo.build import (build_engine_with_weights, max_prompt_len, model_source,  # noqa: E402
                                               data_options, reward_options)
from splash_rollout.recipes.grpo.evaluation import mcnemar_exact_p  # noqa: E402
from splash_rollout.recipes.grpo.reward_fns import RewardFunction  # noqa: E402
from splash_rollout.recipes.grpo.task_data import build_task_data  # noqa: E402
from splash_rollout.models.tokenizer import load_tokenizer  # noqa: E402
from splash_rollout.rollout.types import SamplingParams  # noqa: E402


def policies(run_dir: str) -> dict[str, str]:
    """name -> state-dict path: ``sft`` (the policy GRPO started from) and ``step_N`` checkpoints."""
    found = {}
    if os.path.exists(os.path.join(run_dir, "sft_policy.pt")):
        found["sft"] = os.path.join(run_dir, "sft_policy.pt")
    for path in sorted(glob.glob(os.path.join(run_dir, "checkpoints", "step_*", "policy.pt"))):
        found[f"step_{int(os.path.basename(os.path.dirname(path))[5:])}"] = path
    if len(found) < 2:
        raise SystemExit(f"{run_dir}: need sft_policy.pt and/or checkpoints/step_*/policy.pt (two policies at "
                         f"least), found {sorted(found) or 'none'}; run the recipe with trainer.save_every")
    return found


def correct_per_prompt(cfg, weights: dict[str, torch.Tensor], examples, tokenizer, reward_fn) -> np.ndarray:
    """1/0 per held-out prompt: the greedy answer of this policy is right. [P] int64"""
    engine = build_engine_with_weights(cfg, weights, version=0)
    try:
        batch = engine.generate([ex.prompt_ids for ex in examples],
                                SamplingParams(n=1, temperature=0.0, max_new_tokens=int(cfg.eval.max_new_tokens),
                                               stop_token_ids=tuple(tokenizer.eos_token_ids)))
    finally:
        engine.shutdown()
    samples = [g.samples[0] for g in batch.groups]
    scored = reward_fn([tokenizer.decode(s.response_ids) for s in samples], examples,
                       [s.response_ids for s in samples])
    return np.asarray(scored.correct, dtype=np.int64)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a recipe's run directory")
    ap.add_argument("--first", default="sft", help="the earlier policy (default: sft)")
    ap.add_argument("--last", default=None, help="the later policy (default: the last checkpoint)")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)

    config_path = os.path.join(args.run_dir, ".hydra", "config.yaml")
    if not os.path.exists(config_path):
        raise SystemExit(f"{args.run_dir}: no .hydra/config.yaml (not a recipe's run directory)")
    cfg = OmegaConf.load(config_path)
    cfg.engine.parallel.world_size = 1  # one rank: the tokens are the same in every layout
    found = policies(args.run_dir)
    last = args.last or list(found)[-1]
    for name in (args.first, last):
        if name not in found:
            raise SystemExit(f"--first/--last: no policy {name!r}; expected one of {sorted(found)}")

    tokenizer = load_tokenizer(cfg.model.tokenizer or model_source(cfg))
    data = build_task_data(data_options(cfg), tokenizer, max_prompt_len(cfg), need_eval=True, sft_examples=0, fresh_prompts=0)
    examples = data.eval[:cfg.eval.max_prompts] if cfg.eval.get("max_prompts") else data.eval
    reward_fn = RewardFunction(reward_options(cfg))
    correct = {}
    for name in dict.fromkeys([args.first, *found, last]):
        correct[name] = correct_per_prompt(cfg, torch.load(found[name], map_location="cpu"), examples, tokenizer,
                                           reward_fn)
        print(f"[paired_eval] {name}: accuracy {correct[name].mean():.3f} on {len(examples)} prompts", flush=True)
    a, b = correct[args.first], correct[last]
    gained, lost = int(((a == 0) & (b == 1)).sum()), int(((a == 1) & (b == 0)).sum())
    out = {"run_dir": os.path.abspath(args.run_dir), "prompts": len(examples),
           "accuracy": {k: float(v.mean()) for k, v in correct.items()}, "first": args.first, "last": last,
           "gained": gained, "lost": lost, "mcnemar_exact_p_two_sided": mcnemar_exact_p(gained, lost)}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
