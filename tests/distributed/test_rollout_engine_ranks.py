"""RolloutEngine on 2 ranks in both launch modes: spawned by the engine, and hosted by torchrun."""
import json
import os
import subprocess
import sys

import pytest
import torch

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams
from tests.pinned_profile import PINNED_PROFILE

PROMPTS = [[5, 6, 7] * 30, [9] * 3, [11, 12] * 40]
PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=5, ignore_eos=True)


def _responses(batch):
    return [[s.response_ids for s in g.samples] for g in batch.groups]


@pytest.fixture(scope="module")
def single():
    with RolloutEngine(EngineConfig(model="glm5-nano", max_num_batched_tokens=64, page_size=8)) as engine:
        return _responses(engine.generate(PROMPTS, PARAMS))


def test_spawned_ranks_equal_single_rank(single):
    with RolloutEngine(EngineConfig(model="glm5-nano", world_size=2, layout="dop", max_num_batched_tokens=64,
                                    page_size=8)) as engine:
        batch = engine.generate(PROMPTS, PARAMS)
        assert _responses(batch) == single
        assert batch.timeline.phases[0]["layout"] == "dop"
        with pytest.raises(ValueError, match=r"prompts\[0\]: token ids \[9999\] outside the vocabulary"):
            engine.generate([[9999]], PARAMS)
        assert _responses(engine.generate(PROMPTS, PARAMS)) == single  # still serving after bad input


@pytest.mark.slow
def test_torchrun_ranks_host_the_engine(single, tmp_path):
    out = tmp_path / "gen"
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--standalone", "tests/distributed/torchrun_generate.py", "cp", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"gen.rank{rank}.json").read_text()) == single


def test_world_size_must_divide_heads():
    with pytest.raises(ValueError, match="world_size: 3 does not divide num_heads=8"):
        RolloutEngine(EngineConfig(model="glm5-nano", world_size=3))


def test_switch_schedule_and_switch_layout_show_in_the_timeline(single):
    cfg = EngineConfig(model="glm5-nano", world_size=2, layout="tp", max_num_batched_tokens=64, page_size=8,
                       switch_schedule={3: "dp"})
    with RolloutEngine(cfg) as engine:
        batch = engine.generate(PROMPTS, PARAMS)
        assert _responses(batch) == single
        t = batch.timeline.to_dict()
        assert [p["layout"] for p in t["phases"]] == ["tp", "dp"]
        (sw,) = t["switches"]
        assert (sw["src"], sw["dst"], sw["step"], sw["deferred_reason"]) == ("tp", "dp", 3, None)
        assert len(sw["bytes_sent"]) == 2 and sw["bytes_received"][0] > 0 and sw["overhead_ms"] >= 0
        assert batch.metrics["layout/switches"] == 1.0
        engine.switch_layout("cp")
        again = engine.generate(PROMPTS, PARAMS)
        assert _responses(again) == single
        assert again.timeline.phases[0]["layout"] == "cp" and again.timeline.switches[0]["src"] == "dp"
    with pytest.raises(ValueError, match=r"switch_schedule\[2\]: unknown layout 'zz'"):
        EngineConfig(world_size=2, switch_schedule={2: "zz"})


def test_update_weights_slices_into_every_layout_and_rejects_bad_pushes():
    from splash_rollout.models.model import MLAForCausalLM
    from splash_rollout.models.config import PRESETS

    new = MLAForCausalLM.from_config(PRESETS["glm5-nano"], seed=99).state_dict()
    with RolloutEngine(EngineConfig(model="glm5-nano", max_num_batched_tokens=64, page_size=8)) as one:
        one.update_weights(new, version=3)
        want = _responses(one.generate(PROMPTS, PARAMS))
    cfg = EngineConfig(model="glm5-nano", world_size=2, layout="dop", max_num_batched_tokens=64, page_size=8,
                       switch_schedule={2: "dp"})
    with RolloutEngine(cfg) as engine:
        with pytest.raises(ValueError, match="update_weights: model.norm.weight: expected shape"):
            engine.update_weights({**new, "model.norm.weight": torch.zeros(3)})
        with pytest.raises(ValueError, match="unknown parameter names"):
            engine.update_weights({"nope": torch.zeros(1)})
        engine.update_weights(new, version=3)  # in DOP: head slices of Q-B/KV-B/O, experts spread
        batch = engine.generate(PROMPTS, PARAMS)  # switches into DP-attention (all heads) at step 2
        assert _responses(batch) == want
        assert batch.groups[0].samples[0].weight_version == 3


def test_weights_push_and_sleep_after_live_switches():
    """A switch builds the destination's shards and pools inside a serving step (inference mode); the
    RL loop then pushes weights into them and sleeps/wakes them. Every layout entered live."""
    from splash_rollout.models.config import PRESETS
    from splash_rollout.models.model import MLAForCausalLM

    pushes = [MLAForCausalLM.from_config(PRESETS["glm5-nano"], seed=s).state_dict() for s in (41, 42)]
    want = []
    with RolloutEngine(EngineConfig(model="glm5-nano", max_num_batched_tokens=64, page_size=8)) as one:
        for w in pushes:
            one.update_weights(w)
            want.append(_responses(one.generate(PROMPTS, PARAMS)))
    cfg = EngineConfig(model="glm5-nano", world_size=2, layout="dp", max_num_batched_tokens=64, page_size=8,
                       switch_schedule={2: "tp", 4: "cp", 6: "dop"})
    with RolloutEngine(cfg) as engine:
        engine.generate(PROMPTS, PARAMS)  # dp -> tp -> cp -> dop, each built mid-call
        engine.update_weights(pushes[0], version=1)
        engine.sleep()
        engine.wake_up()
        assert _responses(engine.generate(PROMPTS, PARAMS)) == want[0]
        engine.switch_layout("dp")  # all heads again, all-gathered live
        engine.generate(PROMPTS, PARAMS)
        engine.update_weights(pushes[1], version=2)
        batch = engine.generate(PROMPTS, PARAMS)
        assert _responses(batch) == want[1] and batch.groups[0].samples[0].weight_version == 2


def test_auto_layout_follows_a_draining_batch_and_records_why():
    """Under a tight memory budget (2.5 MiB per rank) DOP's pools admit more of a wide queue than
    DP-attention's; with the pinned profile (tests/pinned_profile.py) the policy moves into DOP while the queue lasts
    and out of it once two long requests are left -- and the outputs equal one rank's."""
    prompts = [[5 + i % 50] * (16 + (7 * i) % 24) for i in range(24)] + [[9] * 60, [11] * 50]
    params = ([SamplingParams(temperature=0, max_new_tokens=8 + (5 * i) % 16, ignore_eos=True) for i in range(24)]
              + [SamplingParams(temperature=0, max_new_tokens=160, ignore_eos=True)] * 2)
    with RolloutEngine(EngineConfig(model="glm5-nano", page_size=16, max_num_batched_tokens=512)) as one:
        want = [s.response_ids for s in one.generate(prompts, params).samples]
    # worst-case admission: the pools' capacity is what each layout reserves, the regime this pins
    # down; θ as the profile gives it (a corrected θ follows this machine's load)
    cfg = EngineConfig(model="glm5-nano", world_size=2, layout="auto", profile=PINNED_PROFILE, page_size=16,
                       max_num_batched_tokens=512, memory_budget_gib=2.5 / 1024, admission="worst_case",
                       online_correction=False)
    with RolloutEngine(cfg) as engine:
        batch = engine.generate(prompts, params)
    assert [s.response_ids for s in batch.samples] == want
    t = batch.timeline.to_dict()
    first, *later = t["decisions"]
    assert first["step"] == 0 and set(first["step_costs"]) == {"tp", "cp", "dp", "dop"}
    assert t["phases"][0]["layout"] == first["chosen"]
    moves = [d for d in later if d["switch"]]
    assert moves and all(d["logged"] == "switch" for d in moves)  # the policy moved as the batch drained
    assert all(d["logged"] == "drained" and not d["switch"] for d in later if d not in moves)
    into_dop = [d for d in moves if d["chosen"] == "dop"]
    assert into_dop and "admits" in into_dop[0]["reason"]  # capacity that changes admission
    assert into_dop[0]["admitted"]["dop"] > into_dop[0]["admitted"]["dp"]
    assert t["phases"][-1]["layout"] != "dop" and t["phases"][-1]["batch_size_start"] <= 2  # the drained tail
    assert all(s["deferred_reason"] is None for s in t["switches"])


def test_auto_runs_a_request_only_a_sharded_layout_can_hold():
    """At 2.5 MiB per rank DP-attention's pool holds 368 tokens, TP's and DOP's 768: a 300 + 200
    token request is refused by a fixed DP engine, while auto accepts it and the policy moves out of
    DP (its pool admits nothing) before the step that runs it; the tokens equal one rank's."""
    prompt, params = [[7] * 300], SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True)
    with RolloutEngine(EngineConfig(model="glm5-nano", page_size=16, max_num_batched_tokens=512)) as one:
        want = one.generate(prompt, params).samples[0].response_ids
    small = dict(model="glm5-nano", world_size=2, page_size=16, max_num_batched_tokens=512,
                 memory_budget_gib=2.5 / 1024)
    with pytest.raises(ValueError, match="KV pages"):
        with RolloutEngine(EngineConfig(layout="dp", **small)) as fixed:
            fixed.generate(prompt, params)
    with RolloutEngine(EngineConfig(layout="auto", **small)) as engine:
        batch = engine.generate(prompt, params)
    assert batch.samples[0].response_ids == want
    t = batch.timeline.to_dict()
    assert t["phases"][0]["layout"] in ("tp", "dop") and t["phases"][0]["steps"] > 0
    assert t["decisions"][0]["admitted"]["dp"] == 0 and t["decisions"][0]["chosen"] in ("tp", "dop")


def test_auto_horizon_learns_from_samples_that_stopped():
    """Samples that end at a stop token long before max_new_tokens: once enough have stopped, the
    policy's horizon (steps the batch keeps running) is their median residual length, not the cap."""
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=96, seed=3, stop_token_ids=tuple(range(2, 60)))
    # without prompt sharing the samples' prefills spill over two steps, so a group's samples do not all
    # end in the same step and the tail keeps a checkpoint (with sharing every sample starts in step 0)
    cfg = EngineConfig(model="glm5-nano", world_size=2, layout="auto", page_size=16, max_num_batched_tokens=512,
                       prefix_sharing=False)
    with RolloutEngine(cfg) as engine:
        batch = engine.generate([[5 + i] * (8 + i) for i in range(12)], params)
    lengths = sorted(len(s.response_ids) for s in batch.samples)
    assert sum(s.finish_reason == "stop" for s in batch.samples) >= 40 and lengths[len(lengths) // 2] < 20
    decisions = batch.timeline.to_dict()["decisions"]
    assert decisions[0]["horizon_steps"] == 96  # nothing has stopped yet: the cap
    later = [d["horizon_steps"] for d in decisions if d["logged"] == "drained"]
    # an early checkpoint may still say the cap: every sample that stopped was shorter than the ones
    # running, which says nothing about how much longer those run; by the tail it has learned
    assert later and later[-1] < 48, later
