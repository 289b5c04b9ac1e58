"""SFT demonstrations of the calculator on arithmetic chains, so a small policy learns to call it.

A chain ``1+2+1+3+2-1=?`` becomes, for a demonstration, one call per ``tool.demo_chunk`` operators,
each later call starting from the previous result, and the answer copied from the last reply::

    calc[1+2+1+3+2]=9\\ncalc[9-1]=8\\n#8

The replies (``=9\\n``) are the environment's: they are tokenized on their own, exactly as the rollout
appends them, and masked out of the SFT loss (the model learns to call and to read, never to
predict the calculator). A seeded share ``tool.sft_demo_fraction`` of the examples are
demonstrations; the rest keep the step-by-step solution, so after SFT the policy does both and GRPO
has a choice to learn from.
"""
from __future__ import annotations

import random
import re

from splash_rollout.recipes.grpo.task_data import Example
from splash_rollout.recipes.grpo.tool_env import CLOSE, OPEN, CalculatorEnv, evaluate, render_value

_CHAIN = re.compile(r"^(\d+)((?:[+\-]\d+)+)=\?$")
_OP = re.compile(r"[+\-]\d+")


def demo_segments(prompt: str, chunk: int) -> list[tuple[str, bool]]:
    """(text, written by the model) segments of the demonstration for a chain prompt ``a+b-c=?``."""
    m = _CHAIN.match(prompt)
    if m is None:
        raise ValueError(f"tool demonstration: expected an arithmetic chain like '1+2-1=?', got {prompt!r}")
    value, ops = m.group(1), _OP.findall(m.group(2))
    segments: list[tuple[str, bool]] = []
    for k in range(0, len(ops), chunk):
        expr = value + "".join(ops[k:k + chunk])
        value = render_value(evaluate(expr, max_chars=10**6))
        segments += [(f"{OPEN}{expr}{CLOSE}", True), (f"={value}\n", False)]
    return segments + [(f"#{value}", True)]


def is_demo(example: Example, fraction: float, seed: int) -> bool:
    """Whether this SFT example is written as a calculator demonstration (seeded by its index)."""
    return random.Random(seed * 1_000_003 + example.index).random() < fraction


def sft_target(example: Example, tokenizer, env: CalculatorEnv) -> tuple[list[int], list[int]]:
    """(ids [num_target_tokens], loss mask [num_target_tokens]) of one SFT example, eos included:
    a calculator demonstration (replies masked) or the example's own target (all trained)."""
    eos = tokenizer.eos_token_ids[0]
    cfg = env.config
    if not is_demo(example, cfg.sft_demo_fraction, cfg.seed):
        ids = tokenizer.encode(example.target) + [eos]
        return ids, [1] * len(ids)
    ids, mask = [], []
    for text, by_model in demo_segments(example.row["prompt"], cfg.demo_chunk):
        part = tokenizer.encode(text)
        if by_model and text.endswith(CLOSE) and part[-1] != env.close_id:
            raise AssertionError(f"tool demonstration: {text!r} does not end in the call's stop token")
        ids += part
        mask += [int(by_model)] * len(part)
    return ids + [eos], mask + [1]
