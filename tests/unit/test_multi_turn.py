"""The multi-turn rollout loop: each trajectory is its sampled turns and the environment's replies,
with the replies masked (loss mask 0, logprob 0), every token stamped with the weight version, the
token budget and turn limit kept, and the groups in prompt order; the trainer's loss gives the
masked tokens no gradient."""
from __future__ import annotations

import pytest
import torch

from splash_rollout.recipes.grpo.loss import GRPOLossConfig, grpo_loss
from splash_rollout.recipes.grpo.multi_turn import MultiTurnEngine, merge_timelines, multi_turn_generate
from splash_rollout.recipes.grpo.trainer import collate
from splash_rollout.recipes.grpo.update import UpdateConfig, _response_mask, grpo_update
from splash_rollout import EngineConfig, RolloutEngine, SamplingParams
from splash_rollout.models.config import PRESETS
from splash_rollout.models.model import MLAForCausalLM
from splash_rollout.rollout.types import Timeline

pytestmark = pytest.mark.usefixtures("no_leftover_process_group")

PROMPTS = [[5, 6, 7, 8] * 3, [9, 10, 11], [12] * 9]
CALL_IDS = tuple(range(100, 260))
"""A stand-in tool: a random-init model ends a turn on one of these ~31% of tokens."""
REPLY_OK, REPLY_BAD = [40, 41, 42], [43, 44]


class StubEnv:
    """Calls end on any of ``CALL_IDS``; the reply depends on the turn's parity (errors: odd length)."""

    stop_token_ids = CALL_IDS

    def __init__(self) -> None:
        self.replies: list[list[int]] = []

    def called(self, turn_ids, finish_reason):
        return finish_reason == "stop" and bool(turn_ids) and turn_ids[-1] in CALL_IDS

    def reply_ids(self, turn_ids):
        bad = len(turn_ids) % 2 == 1
        return list(REPLY_BAD if bad else REPLY_OK), bad


def _turns(sample):
    """Split a trajectory back into (sampled turn, reply) pairs by walking it: a sampled turn ends on
    its first call token, a reply is one of the two stub replies."""
    ids, mask, out, i = sample.response_ids, sample.loss_mask, [], 0
    while i < len(ids):
        j = i
        while j < len(ids) and mask[j] == 1 and ids[j] not in CALL_IDS:
            j += 1
        turn = ids[i:min(j + 1, len(ids))]
        i += len(turn)
        reply = []
        if i < len(ids) and mask[i] == 0:
            reply = REPLY_OK if ids[i:i + 3] == REPLY_OK else REPLY_BAD
            assert ids[i:i + len(reply)] == reply and mask[i:i + len(reply)] == [0] * len(reply)
            i += len(reply)
        out.append((turn, reply))
    return out


@pytest.fixture(scope="module")
def rolled():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: much faster than oversubscribed cores under load
    try:
        yield _roll()
    finally:
        torch.set_num_threads(threads)


def _roll():
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=20, seed=11)
    with RolloutEngine(EngineConfig(model="glm5-nano", num_pages=512, page_size=8, numerics="reproducible")) as engine:
        engine.update_weights(MLAForCausalLM.from_config(PRESETS["glm5-nano"], seed=0).state_dict(), version=3)
        batch = multi_turn_generate(engine, StubEnv(), PROMPTS, params, max_turns=3)
        again = multi_turn_generate(engine, StubEnv(), PROMPTS, params, max_turns=3)
    return batch, again, params


def test_trajectories_have_the_replies_masked_and_the_versions_stamped(rolled):
    batch, again, params = rolled
    assert [g.prompt_index for g in batch.groups] == [0, 1, 2]
    calls = env_tokens = 0
    for g in batch.groups:
        assert len(g.samples) == params.n
        for s in g.samples:
            n = len(s.response_ids)
            assert s.prompt_ids == PROMPTS[g.prompt_index]
            assert len(s.response_logprobs) == len(s.loss_mask) == len(s.token_versions) == n
            assert 0 < n <= params.max_new_tokens  # the budget is the whole trajectory's
            assert s.token_versions == [3] * n
            turns = _turns(s)
            assert 1 <= len(turns) <= 3
            for k, (turn, reply) in enumerate(turns):
                assert turn and all(t not in CALL_IDS for t in turn[:-1])
                if reply:  # an answered call: the turn ended on a call token, the next one followed
                    assert turn[-1] in CALL_IDS and k + 1 < len(turns)
                    assert reply == (REPLY_BAD if len(turn) % 2 else REPLY_OK)
            masked = [i for i, m in enumerate(s.loss_mask) if m == 0]
            assert all(s.response_logprobs[i] == 0.0 for i in masked)
            assert all(s.response_logprobs[i] < 0.0 for i in range(n) if s.loss_mask[i] == 1)
            last_turn = turns[-1][0]
            if last_turn[-1] in CALL_IDS:  # an unanswered call: cut by the turn limit or the budget
                assert s.finish_reason == "length"
                assert len(turns) == 3 or n + 2 >= params.max_new_tokens
            calls += sum(1 for _, r in turns if r)
            env_tokens += len(masked)
    m = batch.metrics
    num = len(PROMPTS) * params.n
    assert calls >= 4 and m["tool/calls_per_sample"] == calls / num and m["tool/env_tokens"] == env_tokens
    assert m["tool/turns_mean"] == 1 + calls / num
    assert m["tool/cut_by_limit"] >= 1
    assert m["perf/steps"] == sum(p["steps"] for p in batch.timeline.phases)
    # same seeds, same trajectories
    assert [s.response_ids for s in again.samples] == [s.response_ids for s in batch.samples]


def test_masked_tokens_get_no_gradient_and_no_loss(rolled):
    batch = rolled[0]
    samples = [s for s in batch.samples if 0 in s.loss_mask]
    assert samples
    mb = collate([s.prompt_ids for s in samples], [s.response_ids for s in samples], pad_id=2,
                 response_mask=[_response_mask(s, "keep") for s in samples],
                 per_token={"old": [s.response_logprobs for s in samples]})
    env_positions = torch.zeros_like(mb.loss_mask, dtype=torch.bool)
    for i, s in enumerate(samples):
        start = len(s.prompt_ids) - 1
        for k, m in enumerate(s.loss_mask):
            env_positions[i, start + k] = m == 0
    assert env_positions.any() and (mb.loss_mask[env_positions] == 0).all()
    old = mb.extras["old"]
    logprobs = (old + 0.1 * torch.randn_like(old)).requires_grad_(True)
    adv = torch.linspace(-1, 1, len(samples))
    loss, _ = grpo_loss(logprobs, old, adv, mb.loss_mask, GRPOLossConfig(kl_coef=0.0), normalizer=10.0)
    loss.backward()
    assert (logprobs.grad[env_positions] == 0).all()
    assert (logprobs.grad[mb.loss_mask > 0] != 0).any()
    # whatever the masked positions hold, the loss is the same
    shifted = logprobs.detach().clone()
    shifted[env_positions] += 5.0
    loss2, _ = grpo_loss(shifted, old, adv, mb.loss_mask, GRPOLossConfig(kl_coef=0.0), normalizer=10.0)
    assert torch.equal(loss.detach(), loss2)


def test_grpo_update_ignores_what_the_environment_tokens_hold(rolled):
    """One GRPO step through the trainer: garbage logprobs on the replies change nothing; training
    the replies as if sampled does change the weights (the test can fail)."""
    import copy

    from splash_rollout.recipes.grpo.trainer import Trainer, TrainerConfig

    batch = rolled[0]
    assert any(0 in s.loss_mask for s in batch.samples)
    advantages = torch.linspace(-1, 1, len(batch.samples)).view(len(batch.groups), -1)

    def step(b):
        trainer = Trainer(MLAForCausalLM.from_config(PRESETS["glm5-nano"], seed=0),
                          TrainerConfig(backend="torch", lr=1e-2))
        grpo_update(trainer, b, advantages, UpdateConfig(loss=GRPOLossConfig(), micro_batch_size=16, max_new_tokens=20),
                    pad_id=2, step=0)
        return trainer.named_weights()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        base = step(batch)
        garbled, unmasked = copy.deepcopy(batch), copy.deepcopy(batch)
        for s in garbled.samples:
            s.response_logprobs = [lp if m else -30.0 for lp, m in zip(s.response_logprobs, s.loss_mask)]
        for s in unmasked.samples:
            s.response_mask = None
        same, moved = step(garbled), step(unmasked)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(base[k], same[k]) for k in base)
    assert not all(torch.equal(base[k], moved[k]) for k in base)


def test_one_turn_is_a_plain_generate_and_bad_input_is_refused():
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=5, stop_token_ids=CALL_IDS)
    with RolloutEngine(EngineConfig(model="glm5-nano", num_pages=256, page_size=8)) as engine:
        plain = engine.generate(PROMPTS, params)
        single = multi_turn_generate(engine, StubEnv(), PROMPTS, params, max_turns=1)
        assert [s.response_ids for s in single.samples] == [s.response_ids for s in plain.samples]
        assert single.metrics["tool/calls_per_sample"] == 0.0
        with pytest.raises(ValueError, match="max_turns"):
            multi_turn_generate(engine, StubEnv(), PROMPTS, params, max_turns=0)
        wrapped = MultiTurnEngine(engine, StubEnv(), 2)
        with pytest.raises(ValueError, match="streaming options"):
            wrapped.generate(PROMPTS, params, target_groups=1)
        assert wrapped.weight_version == engine.weight_version  # the rest is the engine's


def test_timelines_are_laid_end_to_end():
    a = Timeline(phases=[{"layout": "tp", "t_start": 0.0, "t_end": 1.0, "steps": 4,
                          "batch_curve": [[0.0, 8], [1.0, 2]]}],
                 switches=[{"step": 2, "src": "dp", "dst": "tp"}])
    b = Timeline(phases=[{"layout": "tp", "t_start": 0.0, "t_end": 0.5, "steps": 3,
                          "batch_curve": [[0.0, 2], [0.5, 0]]}],
                 switches=[{"step": 1, "src": "tp", "dst": "dop"}])
    m = merge_timelines([a, b])
    assert [(p["t_start"], p["t_end"]) for p in m.phases] == [(0.0, 1.0), (1.0, 1.5)]
    assert m.phases[1]["batch_curve"] == [[1.0, 2], [1.5, 0]]
    assert [s["step"] for s in m.switches] == [2, 5]


def test_a_policy_taught_to_call_gets_the_calculators_replies():
    """A policy overfit on two demonstrations calls the calculator; each trajectory holds its call,
    the evaluator's reply to exactly that call (masked), and its answer turn."""
    import re

    from splash_rollout.recipes.grpo.task_data import Example
    from splash_rollout.recipes.grpo.tool_demos import sft_target
    from splash_rollout.recipes.grpo.tool_env import CalculatorEnv, ToolConfig
    from splash_rollout.recipes.grpo.trainer import Trainer, TrainerConfig
    from splash_rollout.models.tokenizer import load_tokenizer

    tok = load_tokenizer("glm5-nano")
    env = CalculatorEnv(ToolConfig(sft_demo_fraction=1.0), tok)
    examples = [Example(tok.encode(p), {"prompt": p}, None, None, "sft", i)
                for i, p in enumerate(["3+4+2=?", "9-5-1=?"])]
    targets = [sft_target(ex, tok, env) for ex in examples]
    trainer = Trainer(MLAForCausalLM.from_config(PRESETS["glm5-nano"], seed=0), TrainerConfig(backend="torch", lr=3e-3))
    mb = collate([ex.prompt_ids for ex in examples], [t[0] for t in targets], 2, response_mask=[t[1] for t in targets])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: 10x faster than oversubscribed cores under load
    try:
        # until the two demonstrations are memorised: at lr 3e-3 the loss spikes now and then (0.003
        # at step 90, 0.34 at step 100 on one CPU), so a fixed step count passes on one machine only
        for _ in range(400):
            out = trainer.optimizer_step([mb], lambda lp, b: (-(lp * b.loss_mask).sum() / b.loss_mask.sum(), {}),
                                         temperature=1.0)
            if out["loss"] < 1e-3:
                break
        assert out["loss"] < 1e-3, out
    finally:
        torch.set_num_threads(threads)
    with RolloutEngine(EngineConfig(model="glm5-nano", num_pages=256, page_size=8, numerics="reproducible")) as engine:
        engine.update_weights(trainer.named_weights(), version=1)
        params = SamplingParams(n=1, temperature=0.0, max_new_tokens=32, stop_token_ids=tuple(tok.eos_token_ids))
        batch = multi_turn_generate(engine, env, [ex.prompt_ids for ex in examples], params, max_turns=3)
    texts = [tok.decode(s.response_ids) for s in batch.samples]
    assert batch.metrics["tool/calls_per_sample"] == 1.0 and batch.metrics["tool/turns_mean"] == 2.0, texts
    for s in batch.samples:
        k = s.loss_mask.index(0)
        call, rest = tok.decode(s.response_ids[:k]), s.response_ids[k:]
        assert re.fullmatch(r"calc\[[0-9+\-*/]+\]", call), call
        reply = tok.encode(env.reply_text(call)[0])
        assert rest[:len(reply)] == reply and s.loss_mask[k:k + len(reply)] == [0] * len(reply)
        assert all(m == 1 for m in s.loss_mask[k + len(reply):]) and s.finish_reason == "stop"
        assert s.token_versions == [1] * len(s.response_ids)
    assert texts == ["calc[3+4+2]=9\n#9", "calc[9-5-1]=3\n#3"]
