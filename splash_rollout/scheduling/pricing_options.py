"""What ``layout="auto"`` and ``speculation="auto"`` price their choices with: EngineConfig's ``pricing`` group."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PricingOptions:
    """The step times ``layout="auto"`` and ``speculation="auto"`` price their choices with."""

    profile: str = "cpu"
    """Hardware profile: a preset (cpu, h100, h200, b200, ...) or a YAML file (scheduling/profile.py);
    its rates are used, the engine's own pools replace its memory."""
    online_correction: bool = True
    """Correct the profile's step times online from the steps this machine measures (shared
    per-stage-group factors, then per-layout and per-step-shape factors, each shrunk toward the
    profile until observations outweigh it; scheduling/online.py). The factors are in every timeline
    decision (``correction``). False: price with the profile as it is."""

    def __post_init__(self) -> None:
        if not isinstance(self.online_correction, bool):
            raise ValueError(f"online_correction: expected True or False, got {self.online_correction!r}")
