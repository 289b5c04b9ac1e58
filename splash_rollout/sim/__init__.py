"""GPU-scale simulation on the cost model (pure: numpy, matplotlib for figures):
an event-driven continuous-batching engine (``core``), the sweep and drain experiments (``runs``)
and ``python -m splash_rollout.sim``."""
from splash_rollout.sim.core import ADAPTIVE, SimConfig, SimResult, Workload, simulate
from splash_rollout.sim.runs import DEFAULT_INPUTS, drain, drain_workload, sweep

__all__ = ["ADAPTIVE", "DEFAULT_INPUTS", "SimConfig", "SimResult", "Workload", "drain", "drain_workload",
           "simulate", "sweep"]
