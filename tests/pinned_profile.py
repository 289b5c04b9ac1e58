"""The θ the policy scenarios are written against.

A policy test sets up a batch, a queue and a memory budget and asserts the decision the cost model
should lead to; the numbers behind that decision are the profile's. The engine's own ``cpu`` preset
follows the engine as it gets faster (it is recalibrated when the step times move), so the scenarios
pin the ``cpu-torch`` preset, a calibration that no engine change touches.
"""
PINNED_PROFILE = "cpu-torch"
