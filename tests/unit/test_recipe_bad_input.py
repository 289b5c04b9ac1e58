"""The GRPO recipe refuses bad input with a named error before any work: no SFT step, no engine,
nothing in the run directory but what the error leaves."""
from __future__ import annotations

import json
import os
import sys

import pytest

from splash_rollout.recipes.grpo.checkpoint import CheckpointMismatchError, RunState, STATE, step_dir
from splash_rollout.recipes.grpo.reward_fns import RewardError, RewardFnError
from splash_rollout.recipes.grpo.rows import DataRowError, EmptySplitError
from splash_rollout.run import compose_config

pytestmark = pytest.mark.usefixtures("no_leftover_process_group")


@pytest.fixture
def task(tmp_path, monkeypatch):
    rows = [{"messages": [{"role": "user", "content": f"{i}+1=?"}], "meta": {"answer": i + 1}, "solution": f"#{i + 1}"}
            for i in range(12)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "bad_reward.py").write_text("def score(response, row, token_ids):\n    return 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("bad_reward", None)


def run(tmp_path, *overrides):
    from splash_rollout.recipes.grpo.loop import train

    cfg = compose_config(["+recipe=grpo_glm5_file", f"data.path={tmp_path / 'train.jsonl'}", "data.label_key=meta.answer",
                          "logger=none", "engine.parallel.world_size=1", "sft.steps=1", *overrides])
    out = tmp_path / "run"
    with pytest.raises(Exception) as info:
        train(cfg, str(out))
    assert not (out / "sft_policy.pt").exists() and not (out / "metrics.jsonl").exists()  # no work was done
    return info


def test_missing_key_in_a_data_row(task):
    rows = (task / "train.jsonl").read_text().splitlines()
    rows[5] = json.dumps({"messages": [{"role": "user", "content": "x"}], "solution": "#1"})
    (task / "train.jsonl").write_text("\n".join(rows) + "\n")
    info = run(task)
    assert info.type is DataRowError and "row 5 has no 'meta.answer' (data.label_key)" in str(info.value)


def test_reward_fn_that_raises(task):
    info = run(task, "reward.fn=bad_reward:score")
    assert info.type is RewardError
    assert "train row" in str(info.value) and "ZeroDivisionError" in str(info.value) and "Traceback" in str(info.value)


def test_unimportable_reward_fn(task):
    info = run(task, "reward.fn=not_there_at_all:score")
    assert info.type is RewardFnError and "cannot import 'not_there_at_all'" in str(info.value)


def test_bad_reward_option(task):
    info = run(task, "reward.answer_weight=half")
    assert info.type is ValueError and "reward.answer_weight: expected a number, got 'half'" in str(info.value)


def test_empty_eval_split(task):
    info = run(task, "data.eval_fraction=0")
    assert info.type is EmptySplitError and "eval split is empty" in str(info.value)


def test_checkpoint_from_another_model(task):
    other = task / "other_run"
    folder = step_dir(str(other), 4)
    os.makedirs(folder)
    state = RunState(step=4, weight_version=4, data_cursor=64, lr_schedule={}, world_size=1,
                     model={"source": "glm-5", "params": "0123456789abcdef"}, has_reference=False)
    with open(os.path.join(folder, STATE), "w") as f:
        json.dump(state.to_dict(), f)
    info = run(task, f"resume={other}")
    assert info.type is CheckpointMismatchError
    assert "holds model 'glm-5'" in str(info.value) and "this run builds 'glm5-nano'" in str(info.value)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        from splash_rollout.recipes.grpo.checkpoint import latest_checkpoint
        latest_checkpoint(str(task))


def test_bad_loss_option_and_missing_reference(task):
    info = run(task, "grpo.loss_agg=mean")
    assert info.type is ValueError and "grpo.loss_agg" in str(info.value)
    info = run(task, "grpo.kl_coef=0.1", f"grpo.ref_path={task / 'nope.pt'}")
    assert info.type is FileNotFoundError and "grpo.ref_path" in str(info.value)
