"""Counter-based uniform draws: the k-th random number of a sample is a pure function of (seed, k).

Why this exists: a sampler that keeps one ``torch.Generator`` per request carries hidden state that
advances with every draw, so a request's tokens depend on how many draws were made before, and a
request that is retracted and re-run must carry that state along. Here the uniform for response
token k of a sample is ``splitmix64(mix64(seed) + (k + 1) * GAMMA)`` mapped to [0, 1): nothing to
keep, nothing to advance, and a batch of rows is hashed at once on whatever device the rows live.

The hash runs in torch int64 with wrapping multiplication. torch's ``>>`` on int64 is an arithmetic
shift (it copies the sign bit), so every right shift is masked to the bits a logical shift keeps.
``uniform_reference`` is the same function in plain Python integers (the oracle in the tests).
"""
from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
"""splitmix64's increment (2^64 / golden ratio, odd)."""
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB


def to_int64(x: int) -> int:
    """The low 64 bits of a Python integer as a signed int64 value (two's complement)."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 bit patterns (wrapping arithmetic)."""
    z = (z ^ _shr(z, 30)) * to_int64(_MUL1)
    z = (z ^ _shr(z, 27)) * to_int64(_MUL2)
    return z ^ _shr(z, 31)


def uniform(seed: torch.Tensor, draw_index: torch.Tensor) -> torch.Tensor:
    """seed: [R] int64 (64-bit patterns), draw_index: [R] int64 -> [R] float64 in [0, 1), the 53 high
    bits of the hash (every value exactly representable)."""
    z = _mix64(_mix64(seed) + (draw_index + 1) * to_int64(GAMMA))
    return _shr(z, 11).to(torch.float64) * 2.0 ** -53


def uniform_reference(seed: int, draw_index: int) -> float:
    """``uniform`` for one (seed, k) in Python integers."""
    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
        z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
        return z ^ (z >> 31)

    z = mix((mix(seed & _MASK64) + (draw_index + 1) * GAMMA) & _MASK64)
    return (z >> 11) * 2.0 ** -53
