"""The default task: arithmetic chains with a long tail of lengths, as a ``datasets.Dataset``.

A prompt is an expression of small operands, e.g. ``3+1-2+3=?``; the reference solution writes one
step per operator and ends with the answer: ``3+1=4,4-2=2,2+3=5#5``. Running values stay single
digits (0-9) and operands 1-3 by default: small enough that a 1.7M-parameter model learns the
arithmetic in a few hundred SFT steps on 2 CPU cores. The number of
steps follows a power law (many 1-3 step chains, a few 10+), so response lengths in one rollout
batch have the long tail that makes the engine's late, narrow phase worth a different layout.
Everything is generated offline from a seed; no download.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import datasets


@dataclass(frozen=True)
class ChainTaskConfig:
    min_steps: int = 1
    max_steps: int = 12
    """Steps (operators) per chain; drawn with P(k) proportional to k ** -tail_exponent."""
    tail_exponent: float = 1.2
    max_operand: int = 3
    max_value: int = 9
    """Running values stay in [0, max_value]: the operator is drawn among those that can, then the
    operand from the range that keeps the value inside."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(f"steps: expected 1 <= min_steps <= max_steps, got {self.min_steps}, {self.max_steps}")
        if self.max_operand < 1 or self.max_value < self.max_operand:
            raise ValueError(f"max_operand/max_value: got {self.max_operand}, {self.max_value}")


def sample_chain(rng: random.Random, task: ChainTaskConfig) -> dict:
    """One example: prompt, solution (SFT target), answer, num_steps."""
    ks = list(range(task.min_steps, task.max_steps + 1))
    k = rng.choices(ks, weights=[x ** -task.tail_exponent for x in ks])[0]
    value = rng.randint(1, task.max_operand)
    expr, steps = str(value), []
    for _ in range(k):
        ops = [o for o, ok in (("+", value < task.max_value), ("-", value > 0)) if ok]
        op = rng.choice(ops)
        b = rng.randint(1, min(task.max_operand, task.max_value - value if op == "+" else value))
        new = value + b if op == "+" else value - b
        steps.append(f"{value}{op}{b}={new}")
        expr += f"{op}{b}"
        value = new
    return {"prompt": f"{expr}=?", "solution": ",".join(steps) + f"#{value}", "answer": value, "num_steps": k}


def without_answer(solution: str) -> str:
    """A worked solution that stops at its last step, without the ``#<answer>`` the verifier reads
    (``3+1=4,4-2=2#2`` -> ``3+1=4,4-2=2``)."""
    return solution.split("#")[0]


def make_dataset(num_examples: int, seed: int, task: ChainTaskConfig = ChainTaskConfig()) -> datasets.Dataset:
    """``num_examples`` chains, deterministic in ``seed``."""
    rng = random.Random(seed)
    rows = [sample_chain(rng, task) for _ in range(num_examples)]
    return datasets.Dataset.from_list(rows)
