"""The simulator's fleet drain (splash_rollout/sim/fleet.py): placement of whole groups, and the
fleet's time as its slowest replica's."""
import numpy as np
import pytest

from splash_rollout.sim.__main__ import main
from splash_rollout.sim.core import Workload
from splash_rollout.sim.fleet import fleet_drain, place
from splash_rollout.sim.runs import drain_workload


def test_groups_stay_whole_round_robin_cycles_and_by_load_spreads_the_long_prompts():
    # 6 groups of 2: two long prompts first, then four short ones
    work = Workload.make(np.repeat([9000, 8000, 100, 100, 100, 100], 2), 10)
    rr = place(work, 2, 2, "round_robin")
    assert [list(x) for x in rr] == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]]
    by_load = place(work, 2, 2, "by_load")
    assert {0, 2} <= {int(by_load[0][0]), int(by_load[1][0])}  # the two long prompts on different replicas
    for share in by_load:  # whole groups only
        assert all(int(i) // 2 * 2 in share and int(i) // 2 * 2 + 1 in share for i in share)
    with pytest.raises(ValueError, match="not whole groups"):
        place(work, 5, 2, "by_load")


def test_the_fleet_ends_with_its_slowest_replica(tmp_path):
    from splash_rollout.models.config import resolve_model
    from splash_rollout.scheduling import Deployment
    from splash_rollout.scheduling import load_profile

    dep = Deployment.build(resolve_model("glm-5"), load_profile("b200"))
    work = drain_workload(prompts=8, samples=2, prompt_len=(512, 4096), response_lognormal=(5.0, 0.5),
                          max_response=1024, seed=1)
    out = fleet_drain(dep, work, 2, 3)
    for placement in ("round_robin", "by_load"):
        runs = out["placements"][placement]["runs"]
        for mode, r in runs.items():
            assert r["seconds"] == pytest.approx(max(s for s in r["replica_seconds"] if s is not None))
            assert r["tokens_per_s"] == pytest.approx(work.total_tokens / r["seconds"])
            assert sum(r["replica_requests"]) == work.size
        assert out["placements"][placement]["best_fixed"] != "adaptive"
    assert main(["fleet", "--replicas", "2", "--prompts", "4", "--samples", "2", "--prompt-len", "512,2048",
                 "--response-lognormal", "5,0.5", "--max-response", "1024", "--json", str(tmp_path / "f.json")]) == 0
    assert (tmp_path / "f.json").exists()
