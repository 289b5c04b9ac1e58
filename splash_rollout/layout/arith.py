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


def even_split(n: int, parts: int) -> list[int]:
    """n rows in ``parts`` contiguous blocks whose sizes differ by at most one (the larger first)."""
    base, extra = divmod(n, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]
