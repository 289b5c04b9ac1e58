"""The GRPO recipe on a fleet: two glm5-nano replicas (T = 1) on a local Ray instance the fleet
starts and stops, driven by one trainer process through run.py's code path."""
import json

import pytest

from tests.distributed.test_grpo_smoke import REQUIRED, TINY

pytestmark = pytest.mark.usefixtures("no_leftover_process_group")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_grpo_steps_on_a_fleet_of_two_replicas(tmp_path):
    from splash_rollout.run import compose_config, launch

    # the plain torch trainer: DeepSpeed in this (pytest) process would leave its cached world group
    # behind for the next in-process recipe test of this worker
    launch(compose_config(TINY + ["engine.parallel.world_size=1", "engine.fleet.replicas=2", "trainer=torch"]),
           str(tmp_path))
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [0, 1]
    for line in lines:
        assert all(k in line for k in REQUIRED), set(REQUIRED) - set(line)
        assert line["rollout/num_samples"] == 16
    # the trainer's on-policy forward reproduces the replicas' logprobs (reproducible numerics)
    assert all(line["train/logprob_diff_max"] <= 1e-6 for line in lines), [l["train/logprob_diff_max"] for l in lines]
    steps = json.loads((tmp_path / "timeline.json").read_text())["steps"]
    assert len(steps) == 2
    for step in steps:  # both replicas' phases, each tagged
        assert {p["replica"] for p in step["phases"]} == {0, 1}


def test_what_a_fleet_does_not_run_yet_is_refused_by_name(tmp_path):
    from splash_rollout.run import compose_config, launch

    with pytest.raises(ValueError, match=r"engine.fleet.replicas > 1: grpo.oversample_groups"):
        launch(compose_config(TINY + ["engine.parallel.world_size=1", "engine.fleet.replicas=2",
                                      "grpo.oversample_groups=6"]), str(tmp_path))
