"""`+recipe=grpo_glm5_tool` end to end, tiny and on one rank: SFT with calculator demonstrations,
GRPO steps whose rollouts and held-out evaluation are multi-turn, tool/* records every step, and the
trainer's on-policy logprobs equal the engine's over whole trajectories (replies masked out)."""
from __future__ import annotations

import json

import pytest

from splash_rollout.recipes.grpo.build import tool_env
from splash_rollout.models.tokenizer import load_tokenizer
from splash_rollout.run import compose_config

pytestmark = pytest.mark.usefixtures("no_leftover_process_group")

TOOL_KEYS = ("tool/calls_per_sample", "tool/samples_calling", "tool/turns_mean", "tool/errors", "tool/env_tokens",
             "tool/cut_by_limit")
TINY = ["+recipe=grpo_glm5_tool", "sft.steps=3", "sft.batch_size=8", "sft.warmup_steps=1", "grpo.steps=2",
        "grpo.prompts_per_step=3", "grpo.n=3", "grpo.max_new_tokens=24", "trainer.micro_batch_size=9",
        "data.eval_size=3", "eval.every=2", "eval.max_new_tokens=24", "logger=none", "engine.parallel.world_size=1",
        "hardware.threads=1", "sft.save=false"]


@pytest.mark.timeout(300)
def test_tool_recipe_end_to_end(tmp_path):
    from splash_rollout.run import launch

    launch(compose_config(TINY), str(tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["grpo_step"] for r in steps] == [0.0, 1.0]
    for r in steps:
        assert all(k in r for k in TOOL_KEYS), set(TOOL_KEYS) - set(r)
        assert r["tool/turns_mean"] == pytest.approx(1 + r["tool/calls_per_sample"])
        assert 0 <= r["tool/samples_calling"] <= 1 and r["tool/errors"] <= r["tool/calls_per_sample"] * 9
        assert r["rollout/num_samples"] == 9 and r["rollout/response_len/max"] <= 24
        # whole trajectories, replies masked: the trainer's forward reproduces the engine's logprobs
        assert r["train/logprob_diff_max"] <= 1e-6
    assert [r["grpo_step"] for r in rows if "eval/accuracy" in r] == [0.0, 2.0]
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 2 * 3


def test_tool_options_are_checked():
    tok = load_tokenizer("glm5-nano")
    assert tool_env(compose_config(["+recipe=grpo_glm5"]), tok) is None
    assert tool_env(compose_config(["+recipe=grpo_glm5_tool", "tool.enabled=false"]), tok) is None
    env = tool_env(compose_config(["+recipe=grpo_glm5_tool", "tool.max_turns=2"]), tok)
    assert env.config.max_turns == 2 and env.stop_token_ids == (tok.encode("]")[0],)
    with pytest.raises(ValueError, match=r"tool: unknown option\(s\) \['turns'\]"):
        tool_env(compose_config(["+recipe=grpo_glm5_tool", "+tool.turns=2"]), tok)
    with pytest.raises(ValueError, match="grpo.oversample_groups"):
        tool_env(compose_config(["+recipe=grpo_glm5_tool", "grpo.oversample_groups=8"]), tok)
    with pytest.raises(ValueError, match="data.kind is 'file'"):
        tool_env(compose_config(["+recipe=grpo_glm5_tool", "data=file", "data.path=x.jsonl"]), tok)
    with pytest.raises(ValueError, match="tool.max_turns"):
        tool_env(compose_config(["+recipe=grpo_glm5_tool", "tool.max_turns=0"]), tok)
