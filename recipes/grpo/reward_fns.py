"""Reward functions: the built-ins, a user's own by import path, and how the loop calls them.

``reward.fn`` names one of ``BUILTINS`` or ``package.module:function`` importable from ``PYTHONPATH``.
A user function has this signature::

    def score(response: str, row: dict, token_ids: list[int]) -> float | dict[str, float]

``response`` is the decoded completion (special tokens skipped), ``row`` the data row as read from
the file, ``token_ids`` the sampled ids ([num_response_tokens]). A dict must hold ``"reward"``; its
other entries are logged as ``reward/<name>/mean``, and ``"correct"`` (0/1), when present, is what
accuracy counts (else ``reward >= reward.correct_threshold``), and ``"steps"``, a list of
``(end, reward)`` pairs (``end`` a character offset of the response, non-decreasing), scores each step
for process supervision (``grpo.supervision=process``, recipes/grpo/process_credit.py). With ``reward.batched=true`` the
function is called once per step with lists (``responses, rows, token_ids``) and returns a list.

The function is resolved and called once on a probe (train row 0, an empty response) before any
training work, so an unimportable path or a function that raises stops the run at once. Any
exception during training stops the run too, as a ``RewardError`` naming the row and carrying the
traceback: a reward is never silently 0.
"""
from __future__ import annotations

import importlib
import math
import numbers
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from splash_rollout.recipes.grpo.reward import chain_score, chain_steps, parse_answer, score
from splash_rollout.recipes.grpo.task_data import Example
from splash_rollout.recipes.grpo.verifiers import exact_match, math_answer, reasoning_gym_score

BUILTINS = ("chain", "answer", "exact_match", "math", "reasoning_gym")


@dataclass(frozen=True)
class RewardOptions:
    """The recipe's ``reward`` group, typed (its values and their meaning: ``conf/reward/chain.yaml``,
    which owns the defaults; ``recipes/grpo/build.reward_options`` makes this from it)."""

    fn: str
    """A built-in (``BUILTINS``) or ``package.module:function``."""
    batched: bool
    """Your own fn only: one call per step with lists (responses, rows, token_ids) -> list."""
    correct_threshold: float
    """A sample counts as correct when its reward is at least this, unless the fn returns ``correct``."""
    answer_weight: float
    """``chain``: weight of the final answer; the rest is the fraction of right steps."""
    format_reward: float
    """``answer``: reward of a well-formed wrong answer."""

    def __post_init__(self) -> None:
        if not isinstance(self.fn, str) or not self.fn:
            raise ValueError(f"fn: expected one of {BUILTINS} or 'package.module:function', got {self.fn!r}")
        if not isinstance(self.batched, bool):
            raise ValueError(f"batched: expected True or False, got {self.batched!r}")
        for name in ("correct_threshold", "answer_weight", "format_reward"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"{name}: expected a number, got {value!r}")


class RewardFnError(ImportError):
    """``reward.fn`` does not name an importable callable."""


class RewardError(RuntimeError):
    """A reward function raised or returned something that is not a reward."""


@dataclass
class Rewards:
    reward: list[float]
    """[num_samples] the reward the advantages are computed from."""
    correct: list[bool]
    """[num_samples] what accuracy counts."""
    extras: dict[str, list[float]]
    """Other entries of dict rewards, [num_samples] each."""
    steps: list[list[tuple[int, float]] | None] | None = None
    """[num_samples] each sample's ``"steps"`` ([(end, reward)], character offsets of the response)
    when the function scores steps (process supervision); None when no sample has them."""


def _builtin(name: str, r: RewardOptions) -> Callable[[str, Example, list[int]], Any]:
    if name == "chain":  # answer + exact intermediate steps of the arithmetic chain
        return lambda text, ex, ids: {"reward": chain_score(text, ex.label, ex.row["solution"], r.answer_weight),
                                      "correct": float(parse_answer(text) == int(ex.label)),
                                      "answered": float(parse_answer(text) is not None),  # reward/answered/mean
                                      "steps": chain_steps(text, ex.label, ex.row["solution"])}
    if name == "answer":  # the chain's final answer only
        return lambda text, ex, ids: {"reward": score(text, ex.label, r.format_reward),
                                      "correct": float(parse_answer(text) == int(ex.label))}
    if name == "exact_match":
        return lambda text, ex, ids: exact_match(text, ex.label)
    if name == "math":
        return lambda text, ex, ids: math_answer(text, ex.label)
    if name == "reasoning_gym":
        return lambda text, ex, ids: reasoning_gym_score(text, ex.row)
    raise AssertionError(name)


def import_reward_fn(path: str) -> Callable:
    """``package.module:function`` -> the function; a ``RewardFnError`` saying what is wrong."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise RewardFnError(f"reward.fn: expected one of {BUILTINS} or 'package.module:function', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise RewardFnError(f"reward.fn={path}: cannot import {module_name!r} ({type(e).__name__}: {e}); "
                            f"is its folder on PYTHONPATH?") from e
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise RewardFnError(f"reward.fn={path}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise RewardFnError(f"reward.fn={path}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


class RewardFunction:
    """Scores a step's samples with ``reward.fn`` (see the module docstring)."""

    def __init__(self, r: RewardOptions) -> None:
        self.name = r.fn
        self.correct_threshold = float(r.correct_threshold)
        if self.name in BUILTINS:
            self._fn, self.user, self.batched = _builtin(self.name, r), False, False
        else:
            self._fn, self.user, self.batched = import_reward_fn(self.name), True, r.batched

    def _raw(self, responses: list[str], examples: Sequence[Example], token_ids: list[list[int]]) -> list[Any]:
        if not self.user:
            return [self._fn(t, ex, ids) for t, ex, ids in zip(responses, examples, token_ids)]
        if self.batched:
            try:
                out = self._fn(responses, [ex.row for ex in examples], token_ids)
            except Exception:
                rows = sorted({ex.index for ex in examples})
                raise RewardError(f"reward.fn={self.name} raised in a batched call over rows {rows[:8]}"
                                  f"{'...' if len(rows) > 8 else ''} (first row: {examples[0].row!r:.300}):\n"
                                  f"{traceback.format_exc()}") from None
            if not isinstance(out, (list, tuple)) or len(out) != len(responses):
                raise RewardError(f"reward.fn={self.name} (batched): expected a list of {len(responses)} rewards, "
                                  f"got {type(out).__name__} of length {len(out) if hasattr(out, '__len__') else '?'}")
            return list(out)
        out = []
        for t, ex, ids in zip(responses, examples, token_ids):
            try:
                out.append(self._fn(t, ex.row, ids))
            except Exception:
                raise RewardError(f"reward.fn={self.name} raised on {ex.split} row {ex.index} {ex.row!r:.300} "
                                  f"(response {t!r:.200}):\n{traceback.format_exc()}") from None
        return out

    def __call__(self, responses: list[str], examples: Sequence[Example], token_ids: list[list[int]]) -> Rewards:
        rewards, correct, extras, steps = [], [], {}, [None] * len(examples)
        for i, (value, ex) in enumerate(zip(self._raw(responses, examples, token_ids), examples)):
            where = f"reward.fn={self.name} on {ex.split} row {ex.index}"
            if isinstance(value, dict):
                if "reward" not in value:
                    raise RewardError(f"{where}: a dict reward needs a 'reward' entry, got keys {sorted(value)}")
                if "steps" in value:
                    steps[i] = _steps(value["steps"], len(responses[i]), f"{where}: ['steps']")
                for k, v in value.items():
                    if k not in ("reward", "correct", "steps"):
                        extras.setdefault(k, [math.nan] * len(examples))[i] = _number(v, f"{where}: [{k!r}]")
                reward = _number(value["reward"], f"{where}: ['reward']")
                ok = bool(value["correct"]) if "correct" in value else reward >= self.correct_threshold
            else:
                reward = _number(value, where)
                ok = reward >= self.correct_threshold
            rewards.append(reward)
            correct.append(ok)
        return Rewards(rewards, correct, extras, steps if any(x is not None for x in steps) else None)

    def probe(self, example: Example) -> None:
        """One call on (empty response, ``example``, no ids) before any work: surfaces an unusable
        function now, not after SFT."""
        try:
            self([""], [example], [[]])
        except RewardError as e:
            raise RewardError(f"probe call before training (empty response): {e}") from None


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise RewardError(f"{where}: expected a finite number, got {type(value).__name__} {value!r:.80}")
    return float(value)


def _steps(value: Any, text_len: int, where: str) -> list[tuple[int, float]]:
    """A dict reward's ``"steps"``, checked: a non-empty list of (end, reward) with integer ends in
    [0, len(response)], non-decreasing, and finite rewards."""
    if not isinstance(value, (list, tuple)) or not value:
        raise RewardError(f"{where}: expected a non-empty list of (end, reward) pairs, got {value!r:.120}")
    out, prev = [], 0
    for j, pair in enumerate(value):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise RewardError(f"{where}[{j}]: expected an (end, reward) pair, got {pair!r:.80}")
        end, reward = pair
        if isinstance(end, bool) or not isinstance(end, numbers.Integral) or not prev <= end <= text_len:
            raise RewardError(f"{where}[{j}]: end must be an integer character offset in [{prev}, {text_len}] "
                              f"(non-decreasing, within the response), got {end!r}")
        out.append((int(end), _number(reward, f"{where}[{j}] reward")))
        prev = int(end)
    return out
