"""Answer checkers for the built-in rewards: exact match, a math answer checker, reasoning-gym's.

``math_answer`` takes the last ``\\boxed{...}`` of a response, or else its last number, and compares
it with the label after normalising both: spaces, ``$``, thousands separators and a trailing period
go; ``\\frac{a}{b}``, ``a/b``, decimals and integers compare as numbers (1e-9 relative); anything
else compares as the normalised string.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_FRAC = re.compile(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (nested braces kept), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def normalize_answer(value: Any) -> str:
    """Canonical string of an answer: no spaces / ``$`` / trailing period / thousands separators,
    ``\\frac{a}{b}`` as ``a/b``, numbers in lowest terms (``0.50`` and ``1/2`` -> ``1/2``)."""
    s = str(value).strip().replace("$", "").replace(" ", "").rstrip(".")
    s = _FRAC.sub(r"(\1)/(\2)", s).replace("\\left", "").replace("\\right", "")
    s = re.sub(r"^\((-?[\d.]+)\)/\((-?[\d.]+)\)$", r"\1/\2", s)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    try:
        if re.fullmatch(r"-?\d+(\.\d+)?/-?\d+(\.\d+)?", s):
            num, den = s.split("/")
            q = Fraction(num) / Fraction(den)
        elif re.fullmatch(r"-?\d*\.?\d+", s):
            q = Fraction(s)
        else:
            return s
    except (ValueError, ZeroDivisionError):
        return s
    return str(q.numerator) if q.denominator == 1 else f"{q.numerator}/{q.denominator}"


def math_answer(response: str, label: Any) -> float:
    """1.0 when the boxed (else last) number of ``response`` equals ``label``, normalised; else 0.0."""
    got = last_boxed(response)
    if got is None:
        got = last_number(response)
    return float(got is not None and normalize_answer(got) == normalize_answer(label))


def exact_match(response: str, label: Any) -> float:
    """1.0 when the response equals ``str(label)`` up to surrounding whitespace and inner runs of it."""
    squash = lambda s: " ".join(str(s).split())
    return float(squash(response) == squash(label))


def reasoning_gym_score(response: str, row: dict[str, Any]) -> float:
    """reasoning-gym's own verifier for the row's task, on the ``<answer>...</answer>`` part of the
    response (the whole response when there is no tag)."""
    import reasoning_gym

    tagged = _ANSWER_TAG.findall(response)
    answer = (tagged[-1] if tagged else response).strip()
    task = row.get("metadata", {}).get("source_dataset")
    if task is None:
        raise KeyError("reward.fn=reasoning_gym: the row has no metadata.source_dataset (not a reasoning-gym row)")
    return float(reasoning_gym.get_score_answer_fn(task)(answer=answer, entry=row))
