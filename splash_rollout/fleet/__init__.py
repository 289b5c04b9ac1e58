"""A fleet of engine replicas placed by Ray (the ``ray`` extra): ``Fleet``, ``FleetOptions``."""
from splash_rollout.fleet.fleet import Fleet, FleetOptions, FleetRequest, ReplicaLost
from splash_rollout.fleet.placement import Placement, PlacementOptions

__all__ = ["Fleet", "FleetOptions", "FleetRequest", "Placement", "PlacementOptions", "ReplicaLost"]
