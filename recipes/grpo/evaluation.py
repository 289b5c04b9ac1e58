"""Held-out evaluation: greedy accuracy and pass@k of the current policy on the eval split.

Runs on the engine between GRPO steps (the weights it holds are the trainer's latest). Greedy: one
sample per prompt at temperature 0; pass@k: ``n`` samples per prompt at ``temperature`` with fixed
seeds, scored by the run's reward function, with the unbiased estimator
``pass@k = 1 - C(n - c, k) / C(n, k)`` (c correct of n) averaged over prompts. Records: ``eval/accuracy``,
``eval/reward/mean``, ``eval/response_len/mean`` (greedy), ``eval/pass@<k>``, ``eval/sampled/accuracy``,
and the accuracy's 95 % Wilson interval ``eval/accuracy_low`` / ``eval/accuracy_high``.

The policies of one run answer the *same* held-out prompts, so "did GRPO help" is a paired
question: ``paired_comparison`` counts the prompts the later policy gets right and the earlier one
wrong (gained) and the reverse (lost), with McNemar's exact two-sided p-value (an exact binomial
test of gained vs lost at 1/2) for "neither policy is better".
"""
from __future__ import annotations

from dataclasses import dataclass
from math import comb, sqrt

import numpy as np

from splash_rollout.recipes.grpo.reward_fns import RewardFunction
from splash_rollout.recipes.grpo.task_data import Example
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


def mcnemar_exact_p(gained: int, lost: int) -> float:
    """Two-sided exact binomial test of gained vs lost discordant prompts (p = 1/2 each)."""
    n, k = gained + lost, min(gained, lost)
    if n == 0:
        return 1.0
    return min(1.0, 2.0 * sum(comb(n, i) for i in range(k + 1)) / 2.0 ** n)


def wilson_interval(correct: int, total: int, z: float = 1.959964) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion (stays inside [0, 1], sane at 0 or all correct)."""
    if total == 0:
        return 0.0, 1.0
    p = correct / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return (0.0 if correct == 0 else max(0.0, centre - half)), (1.0 if correct == total else min(1.0, centre + half))


def paired_comparison(before, after) -> dict[str, float]:
    """Per-prompt 1/0 correctness of two policies on the same prompts -> accuracy_before,
    accuracy_after, gained, lost, p_value (McNemar exact, two-sided), prompts."""
    a, b = np.asarray(before, dtype=np.int64), np.asarray(after, dtype=np.int64)
    if a.shape != b.shape:
        raise ValueError(f"paired comparison needs the same prompts: {a.shape} vs {b.shape}")
    gained, lost = int(((a == 0) & (b == 1)).sum()), int(((a == 1) & (b == 0)).sum())
    return {"accuracy_before": float(a.mean()), "accuracy_after": float(b.mean()), "gained": gained,
            "lost": lost, "p_value": mcnemar_exact_p(gained, lost), "prompts": int(a.size)}


def evaluate(engine, examples: list[Example], reward_fn: RewardFunction, tokenizer, config: EvalConfig,
             stop_token_ids: tuple[int, ...]) -> dict[str, float]:
    return evaluate_per_prompt(engine, examples, reward_fn, tokenizer, config, stop_token_ids)[0]


def evaluate_per_prompt(engine, examples: list[Example], reward_fn: RewardFunction, tokenizer, config: EvalConfig,
                        stop_token_ids: tuple[int, ...]) -> tuple[dict[str, float], list[int]]:
    """The eval records and the greedy answer's 1/0 correctness per prompt (in eval-split order)."""
    chosen = examples[:config.max_prompts] if config.max_prompts else examples
    prompts = [ex.prompt_ids for ex in chosen]
    greedy = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=config.max_new_tokens,
                                                     stop_token_ids=stop_token_ids, seed=config.seed))
    samples = [g.samples[0] for g in greedy.groups]
    scored = reward_fn([tokenizer.decode(s.response_ids) for s in samples], chosen, [s.response_ids for s in samples])
    correct = [int(bool(c)) for c in scored.correct]
    low, high = wilson_interval(sum(correct), len(correct))
    out = {"eval/accuracy": float(np.mean(correct)), "eval/accuracy_low": low, "eval/accuracy_high": high,
           "eval/reward/mean": float(np.mean(scored.reward)),
           "eval/response_len/mean": float(np.mean([len(s.response_ids) for s in samples])),
           "eval/num_prompts": float(len(chosen))}
    if config.n > 0:
        batch = engine.generate(prompts, SamplingParams(n=config.n, temperature=config.temperature,
                                                        max_new_tokens=config.max_new_tokens,
                                                        stop_token_ids=stop_token_ids, seed=config.seed + 1))
        flat = [(g.prompt_index, s) for g in batch.groups for s in g.samples]
        got = reward_fn([tokenizer.decode(s.response_ids) for _, s in flat], [chosen[i] for i, _ in flat],
                        [s.response_ids for _, s in flat])
        hits = np.array(got.correct, dtype=np.int64).reshape(len(chosen), config.n).sum(axis=1)
        for k in config.k:
            out[f"eval/pass@{k}"] = float(np.mean([pass_at_k(config.n, int(c), k) for c in hits]))
        out["eval/sampled/accuracy"] = float(hits.sum() / (len(chosen) * config.n))
    return out, correct
