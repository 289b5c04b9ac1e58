"""Verifier for the arithmetic-chain task.

``score``: the final answer only -- 1.0 right, ``format_reward`` for a well-formed wrong one
(ends with ``#<int>``), 0.0 otherwise.

``chain_score`` (the recipe's default): ``answer_weight * [answer right] + (1 - answer_weight) *
(steps written exactly as the reference's i-th step) / (reference steps)``. Both parts are checked
against the ground truth, nothing is judged; the step part gives a 1.7M-parameter policy a dense
signal (most groups then have reward variance) and makes skipping steps cost reward, so responses
keep the long tail of lengths the task is built for.

``chain_steps``: the same check per step, for process supervision (``grpo.supervision=process``):
each written step earns 1 while every step up to it matches the reference, 0 from the first wrong
one on, and the answer after ``#`` is a last step that earns 1 when right.
"""
from __future__ import annotations

import re

_ANSWER = re.compile(r"#(-?\d+)\s*$")


def parse_answer(text: str) -> int | None:
    """The integer after the last ``#`` if the response ends with ``#<int>``; else None."""
    m = _ANSWER.search(text)
    return int(m.group(1)) if m else None


def score(text: str, answer: int, format_reward: float = 0.1) -> float:
    got = parse_answer(text)
    if got is None:
        return 0.0
    return 1.0 if got == int(answer) else format_reward


def chain_score(text: str, answer: int, solution: str, answer_weight: float = 0.5) -> float:
    """``solution``: the reference ``a+b=c,c-d=e#e``; ``text``: the response."""
    ref_steps = solution.split("#")[0].split(",")
    steps = text.split("#")[0].split(",")
    matched = sum(1 for got, want in zip(steps, ref_steps) if got.strip() == want)
    right = parse_answer(text) == int(answer)
    return answer_weight * float(right) + (1.0 - answer_weight) * matched / len(ref_steps)


def chain_steps(text: str, answer: int, solution: str) -> list[tuple[int, float]]:
    """[(end, reward)] per written step of ``text`` in order: ``end`` is the character offset just
    past the step (its ``,`` or ``#`` included); a last entry ends at ``len(text)`` and scores the
    answer (the tokens after the last step, the end of sequence included). A step is right while it and every step before it equal the reference's."""
    ref_steps = solution.split("#")[0].split(",")
    body, _, _ = text.partition("#")
    out, pos, intact = [], 0, True
    if body:
        for i, step in enumerate(body.split(",")):
            pos += len(step) + 1  # the separator after it (or the '#' / end of text)
            intact = intact and i < len(ref_steps) and step.strip() == ref_steps[i]
            out.append((min(pos, len(text)), float(intact)))
    # the answer (or its absence: what follows the last step, the end of sequence included)
    out.append((len(text), float(parse_answer(text) == int(answer))))
    return out
