"""Partial rollout in the GRPO recipe (one rank, tiny): the groups a step cut off are finished by the
next step, every asked group is accounted for in every step, the per-token policy lag is logged, the
carry survives a checkpoint and resume, and bad settings are refused."""
from __future__ import annotations

import json
import shutil

import pytest

from splash_rollout.recipes.grpo.checkpoint import CheckpointMismatchError
from splash_rollout.recipes.grpo.metrics import is_wall_clock

# 6 prompts x 4 samples, at most 8 running at once, and a 2-step SFT that makes some responses stop
# early: the first groups finish while later ones are mid-response or not started, so the target of
# 2 cuts groups off in every step
TINY = ["+recipe=grpo_glm5", "sft.steps=2", "sft.batch_size=8", "sft.warmup_steps=1", "grpo.steps=4",
        "grpo.prompts_per_step=2", "grpo.oversample_groups=6", "grpo.n=4", "grpo.max_new_tokens=16", "grpo.filter=none", "grpo.partial_rollout=true",
        "grpo.max_off_policy_steps=1", "engine.batching.max_num_seqs=8", "trainer.micro_batch_size=8", "logger.kind=none",
        "hardware.threads=1", "engine.parallel.world_size=1", "trainer=torch", "eval.every=0",
        "reward.fn=tests.unit.test_dynamic_sampling:parity_reward",
        # where a stopped call cuts its samples follows the steps run, and under speculation "auto" the gate drafts
        # where measured seconds say so: off, the cut (and so which weights wrote which token) is the same every run
        "engine.compute.speculation=off"]


@pytest.fixture
def _no_leftover_process_group():
    import torch.distributed as dist

    was = dist.is_initialized()
    yield
    if not was and dist.is_initialized():
        dist.destroy_process_group()


def _run(run_dir, *extra: str):
    from splash_rollout.run import compose_config, launch

    return launch(compose_config(TINY + list(extra)), str(run_dir))


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(300)
def test_carried_groups_are_finished_next_step_and_every_group_is_counted(tmp_path, _no_leftover_process_group):
    straight = tmp_path / "straight"
    _run(straight, "trainer.save_every=1")
    rows = _rows(straight)
    assert [r["grpo_step"] for r in rows] == [0, 1, 2, 3]
    carried_before = 0.0
    for r in rows:
        trained = r["rollout/kept_groups"]
        assert trained == 2 and r["rollout/num_samples"] == 8  # filter none: every step meets its target
        # nothing lost silently: asked = trained + filtered + carried on + dropped as too stale
        assert r["rollout/asked_groups"] == trained + r["rollout/filtered_groups"] + r["rollout/carried_groups"] \
            + r["rollout/stale_dropped"]
        assert r["rollout/carried_groups"] == r["rollout/aborted_groups"]
        # what the last step carried is resumed here or dropped; fresh prompts fill the 6 asked
        assert r["rollout/resumed_groups"] + r["rollout/stale_dropped"] == carried_before
        assert r["rollout/asked_groups"] - r["rollout/stale_dropped"] == 6
        assert r["rollout/max_token_lag"] <= 1 and 0 <= r["rollout/off_policy_tokens_frac"] <= 1
        # the engine against the trainer on the tokens of the weights being trained
        assert r["train/logprob_diff_max"] <= 1e-5
        carried_before = r["rollout/carried_groups"]
    assert rows[0]["rollout/resumed_groups"] == 0 and rows[0]["rollout/max_token_lag"] == 0
    later = rows[1:]
    assert all(r["rollout/resumed_groups"] > 0 for r in later)
    assert any(r["rollout/resumed_samples"] > 0 for r in later)
    assert any(r["rollout/off_policy_tokens_frac"] > 0 and r["rollout/max_token_lag"] == 1 for r in later)
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["rollout/carried_at_end"] == rows[-1]["rollout/carried_groups"]

    # the carry is in the checkpoint: resumed after step 2, steps 2 and 3 are the straight run's
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    for k in (3, 4):
        shutil.rmtree(resumed / "checkpoints" / f"step_{k:06d}")
    state = json.loads((resumed / "checkpoints" / "step_000002" / "state.json").read_text())
    assert state["carried_groups"] == rows[1]["rollout/carried_groups"] > 0
    _run(resumed, "trainer.save_every=1", f"resume={resumed}")
    got, want = _rows(resumed), rows
    assert [r["grpo_step"] for r in got] == [0, 1, 2, 3]
    for a, b in zip(got[2:], want[2:]):
        same = {k: v for k, v in b.items() if not is_wall_clock(k)}
        assert {k: a[k] for k in same} == same

    # a run without partial rollout would lose the carried groups: refused
    with pytest.raises(CheckpointMismatchError, match="grpo.partial_rollout=true"):
        shutil.rmtree(resumed / "checkpoints" / "step_000003")
        shutil.rmtree(resumed / "checkpoints" / "step_000004")
        _run(resumed, "grpo.partial_rollout=false", f"resume={resumed}")


def test_partial_rollout_needs_over_sampling_and_a_valid_bound():
    from omegaconf import OmegaConf

    from splash_rollout.recipes.grpo.build import partial_rollout_config

    from splash_rollout.run import compose_config

    default = compose_config(["+recipe=grpo_glm5"]).grpo.max_off_policy_steps  # the default lives in conf/
    cfg = lambda **g: OmegaConf.create({"grpo": {"oversample_groups": 6, "partial_rollout": True,  # noqa: E731
                                                 "max_off_policy_steps": default, **g}})
    assert default == 1 and partial_rollout_config(cfg()).max_off_policy_steps == 1
    assert partial_rollout_config(cfg(max_off_policy_steps=None)).max_off_policy_steps is None
    assert partial_rollout_config(cfg(partial_rollout=False)) is None
    with pytest.raises(ValueError, match="grpo.partial_rollout: needs grpo.oversample_groups"):
        partial_rollout_config(cfg(oversample_groups=None))
    with pytest.raises(ValueError, match="grpo.max_off_policy_steps: expected an integer >= 0"):
        partial_rollout_config(cfg(max_off_policy_steps=-1))
    with pytest.raises(ValueError, match="grpo.partial_rollout: expected true or false"):
        partial_rollout_config(cfg(partial_rollout="yes"))
