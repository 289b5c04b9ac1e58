"""``RankFailure``: the one error a caller of spawned ranks sees when a rank dies, times out or raises."""


class RankFailure(RuntimeError):
    """A rank died, timed out or raised; the message says which and why."""
