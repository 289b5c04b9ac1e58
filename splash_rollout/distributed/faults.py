"""Fault injection for tests: make one rank fail at a named point, to show that failures stay clean.

Set ``SPLASH_FAULT`` before the ranks start (spawned workers inherit the environment; under
torchrun set it in the launcher's environment):

* ``switch_transfer:LAYER`` -- raise ``InjectedFault`` inside the switch transfer of layer LAYER on
  every rank; ``switch_transfer:LAYER@RANK`` -- on rank RANK only. It fires after the layer's new
  projection shard is installed and before its KV rows are, so the failing rank holds a genuinely
  half-moved layer (which must never be used afterwards).
* ``rank_start:0@RANK`` -- a ``WorkerGroup`` rank raises before it first answers its caller (it dies,
  and only its stderr tells why); ``rank_start:1@RANK`` -- it raises while joining the process groups
  (it reports the traceback). Without ``@RANK``: on every rank.

Unset (production), a check is one environment lookup per switched layer.
"""
from __future__ import annotations

import os

ENV = "SPLASH_FAULT"


class InjectedFault(RuntimeError):
    """Raised where ``SPLASH_FAULT`` asks for a failure."""


def inject(site: str, index: int, rank: int, unit: str = "layer") -> None:
    """Raise if ``SPLASH_FAULT`` names this site, index (a ``unit``: a layer, a start stage) and rank."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    name, _, where = spec.partition(":")
    if name != site:
        return
    at, _, on = where.partition("@")
    if int(at) == index and (not on or int(on) == rank):
        raise InjectedFault(f"{ENV}={spec}: injected failure in {site} of {unit} {index} on rank {rank}")
