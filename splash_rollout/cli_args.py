"""Argument types shared by the package's command lines (bench, calibrate) and benchmarks/."""
from __future__ import annotations

import argparse


def positive_ints(text: str) -> list[int]:
    """argparse ``type=``: ``"1,4,16"`` -> [1, 4, 16]; anything else is a usage error naming the text."""
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values
