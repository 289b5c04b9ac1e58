"""Integer helpers shared by the pure layers: even division that explains itself, ceilings, units."""
from __future__ import annotations

GiB = 1 << 30
MiB = 1 << 20


def div_even(a: int, b: int) -> int:
    """a / b for sizes that must split evenly (heads over ranks, experts over ranks)."""
    if b <= 0 or a % b:
        raise ValueError(f"{a = } must be divisible by {b = }")
    return a // b


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
