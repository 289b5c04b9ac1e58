"""Which replica of a fleet a prompt goes to: the one that caches its prefix, unless that one is busy.

Why: every replica keeps its own prefix cache (engine/prefix_cache.py), so a prompt that starts the
way an earlier one did -- a GRPO prompt's group (one placement for its ``n`` samples), an agent's
next turn, the same prompt in a later training step -- is only cheap on the replica that served the
earlier one. Placing purely by load (or round robin) would spread an agent's turns over every
replica and prefill each history again; placing purely by prefix would pile a popular system prompt
onto one replica. The rule here is both, in that order:

1. The prompt's prefixes are cut at every ``block_tokens`` boundary (and the whole prompt); each cut
   remembers the replica it was last sent to.
2. Among the replicas whose load is within ``max_imbalance`` samples of the least loaded, take the
   one that was sent the longest of those prefixes.
3. None: the least loaded, ties broken round robin (so an idle fleet spreads distinct prompts).

Load is the samples in flight per replica, counted here (``started`` / ``ended``). The memory of
prefixes is bounded (``max_prefixes``, least recently used dropped first) and forgets a replica
that leaves. Pure bookkeeping with no Ray in it, so it is tested and reasoned about alone.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class PlacementOptions:
    """How the fleet places requests."""

    block_tokens: int = 64
    """Prefixes are remembered at every multiple of this many tokens (and at the prompt's end)."""
    max_imbalance: int = 16
    """A replica more than this many in-flight samples above the least loaded is passed over even if
    it holds the prompt's prefix."""
    max_prefixes: int = 200_000
    """Prefixes remembered (least recently used dropped first)."""

    def __post_init__(self) -> None:
        for name in ("block_tokens", "max_prefixes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"placement.{name}: expected an integer >= 1, got {value!r}")
        if not isinstance(self.max_imbalance, int) or isinstance(self.max_imbalance, bool) or self.max_imbalance < 0:
            raise ValueError(f"placement.max_imbalance: expected an integer >= 0, got {self.max_imbalance!r}")


class Placement:
    """The fleet's placement state: in-flight samples per replica and where prefixes were sent."""

    def __init__(self, options: PlacementOptions = PlacementOptions()) -> None:
        self.options = options
        self.load: dict[int, int] = {}
        """Replica -> samples in flight on it (the replicas that can take requests)."""
        self._sent: OrderedDict[int, int] = OrderedDict()
        """hash of a prefix -> the replica it was last sent to, least recently used first."""
        self._next = 0
        """Round-robin start for ties among equally loaded replicas."""

    # ---- membership -------------------------------------------------------------------------------
    def add(self, replica: int) -> None:
        self.load.setdefault(replica, 0)

    def remove(self, replica: int) -> None:
        """``replica`` left: nothing is placed on it again, and its prefixes are forgotten."""
        self.load.pop(replica, None)
        for key in [k for k, r in self._sent.items() if r == replica]:
            del self._sent[key]

    # ---- placing ----------------------------------------------------------------------------------
    def _prefix_keys(self, tokens: list[int]) -> list[int]:
        """Hashes of the prompt's prefixes, shortest first: every ``block_tokens`` cut and the whole."""
        block, keys, h = self.options.block_tokens, [], 0
        for start in range(0, len(tokens), block):
            h = hash((h, tuple(tokens[start:start + block])))  # chained: one pass over the prompt
            keys.append(h)
        return keys

    def pick(self, tokens: list[int]) -> int:
        """The replica for a prompt of ``tokens`` (see the module docstring). Raises when no replica is left."""
        if not self.load:
            raise RuntimeError("fleet: no replica is left to place a request on")
        least = min(self.load.values())
        eligible = {r for r, n in self.load.items() if n <= least + self.options.max_imbalance}
        for key in reversed(self._prefix_keys(tokens)):
            replica = self._sent.get(key)
            if replica in eligible:
                return replica
        order = sorted(self.load)
        start = self._next % len(order)
        rotated = order[start:] + order[:start]
        choice = min(rotated, key=lambda r: self.load[r])  # min keeps the first of equals
        self._next = order.index(choice) + 1
        return choice

    def started(self, replica: int, tokens: list[int], samples: int) -> None:
        """``samples`` samples of a prompt of ``tokens`` went to ``replica``: remember its prefixes there."""
        if replica in self.load:
            self.load[replica] += samples
        for key in self._prefix_keys(tokens):
            self._sent[key] = replica
            self._sent.move_to_end(key)
        while len(self._sent) > self.options.max_prefixes:
            self._sent.popitem(last=False)

    def ended(self, replica: int, samples: int) -> None:
        if replica in self.load:
            self.load[replica] -= samples
