"""Held-out evaluation: greedy accuracy and pass@k of the current policy on the eval split.

Runs on the engine between GRPO steps (the weights it holds are the trainer's latest). Greedy: one
sample per prompt at temperature 0; pass@k: ``n`` samples per prompt at ``temperature`` with fixed
seeds, scored by the run's reward function, with the unbiased estimator
``pass@k = 1 - C(n - c, k) / C(n, k)`` (c correct of n) averaged over prompts. Records: ``eval/accuracy``,
``eval/reward/mean``, ``eval/response_len/mean`` (greedy), ``eval/pass@<k>``, ``eval/sampled/accuracy``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from recipes.grpo.reward_fns import RewardFunction
from recipes.grpo.task_data import Example
from splash_rollout.rollout.types import SamplingParams


@dataclass(frozen=True)
class EvalConfig:
    every: int = 0
    """Evaluate before GRPO step s when s % every == 0, and after the last step; 0: never."""
    max_prompts: int | None = None
    """The first this many eval examples (None: all)."""
    max_new_tokens: int = 64
    n: int = 0
    """Samples per prompt for pass@k (0: greedy only)."""
    k: tuple[int, ...] = (1,)
    temperature: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"eval.every: expected >= 0, got {self.every}")
        bad = [k for k in self.k if not 1 <= k <= max(self.n, 1)]
        if self.n and bad:
            raise ValueError(f"eval.k: every k must be in [1, eval.n={self.n}], got {list(self.k)}")

    @property
    def enabled(self) -> bool:
        return self.every > 0


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that k of n samples (c of them correct), drawn without replacement, hold one."""
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def evaluate(engine, examples: list[Example], reward_fn: RewardFunction, tokenizer, config: EvalConfig,
             stop_token_ids: tuple[int, ...]) -> dict[str, float]:
    chosen = examples[:config.max_prompts] if config.max_prompts else examples
    prompts = [ex.prompt_ids for ex in chosen]
    greedy = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=config.max_new_tokens,
                                                     stop_token_ids=stop_token_ids, seed=config.seed))
    samples = [g.samples[0] for g in greedy.groups]
    scored = reward_fn([tokenizer.decode(s.response_ids) for s in samples], chosen, [s.response_ids for s in samples])
    out = {"eval/accuracy": float(np.mean(scored.correct)), "eval/reward/mean": float(np.mean(scored.reward)),
           "eval/response_len/mean": float(np.mean([len(s.response_ids) for s in samples])),
           "eval/num_prompts": float(len(chosen))}
    if config.n > 0:
        batch = engine.generate(prompts, SamplingParams(n=config.n, temperature=config.temperature,
                                                        max_new_tokens=config.max_new_tokens,
                                                        stop_token_ids=stop_token_ids, seed=config.seed + 1))
        flat = [(g.prompt_index, s) for g in batch.groups for s in g.samples]
        got = reward_fn([tokenizer.decode(s.response_ids) for _, s in flat], [chosen[i] for i, _ in flat],
                        [s.response_ids for _, s in flat])
        correct = np.array(got.correct, dtype=np.int64).reshape(len(chosen), config.n).sum(axis=1)
        for k in config.k:
            out[f"eval/pass@{k}"] = float(np.mean([pass_at_k(config.n, int(c), k) for c in correct]))
        out["eval/sampled/accuracy"] = float(correct.sum() / (len(chosen) * config.n))
    return out
