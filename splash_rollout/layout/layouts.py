"""The four attention layouts as two independent choices (paper §2).

A layout says where the switchable attention projections live (``Placement``: sharded over the T
ranks by head, or replicated on each) and who holds a request's latent KV history (``Ownership``:
every rank, one owner rank, or its pages spread over the ranks by position). TP, DP-attention, CP
and DOP are four of the six combinations; every number in this package follows from the pair.
"""
from __future__ import annotations

import enum


class Placement(str, enum.Enum):
    """Where Q-B, KV-B and O live."""

    SHARDED = "sharded"  # H/T heads per rank
    REPLICATED = "replicated"  # all H heads on every rank


class Ownership(str, enum.Enum):
    """Which ranks store a request's KV history."""

    EVERY = "every"  # a whole copy on every rank
    OWNER = "owner"  # a whole copy on one owner rank
    POSITIONS = "positions"  # page p of the history on rank p mod T


class Layout(str, enum.Enum):
    """An attention layout; the value is its CLI name."""

    TP = "tp"
    CP = "cp"
    DP = "dp"  # DP-attention
    DOP = "dop"

    @property
    def placement(self) -> Placement:
        return _PAIRS[self][0]

    @property
    def ownership(self) -> Ownership:
        return _PAIRS[self][1]

    @property
    def shards_projections(self) -> bool:
        return self.placement is Placement.SHARDED

    @property
    def title(self) -> str:
        return {"tp": "TP", "cp": "CP", "dp": "DP-attention", "dop": "DOP"}[self.value]

    @classmethod
    def parse(cls, value: "str | Layout", field: str = "layout") -> "Layout":
        """A layout from its CLI name (case-insensitive); a clear error naming ``field`` otherwise."""
        if isinstance(value, Layout):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            names = ", ".join(l.value for l in cls)
            raise ValueError(f"{field}: unknown layout {value!r}; expected one of {names}") from None

    def __str__(self) -> str:
        return self.value


_PAIRS = {
    Layout.TP: (Placement.SHARDED, Ownership.EVERY),
    Layout.CP: (Placement.REPLICATED, Ownership.POSITIONS),
    Layout.DP: (Placement.REPLICATED, Ownership.OWNER),
    Layout.DOP: (Placement.SHARDED, Ownership.OWNER),
}

ALL_LAYOUTS: tuple[Layout, ...] = (Layout.TP, Layout.CP, Layout.DP, Layout.DOP)
