"""Token-budget micro-batches: every sequence trained exactly once, within the budget, and the same
optimizer step however the batch is split."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splash_rollout.recipes.grpo.micro_batches import padded_tokens, plan_micro_batches, plan_rank_micro_batches


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=0, max_size=60), st.integers(1, 16),
       st.one_of(st.none(), st.integers(1, 2000)))
def test_plan_covers_each_sequence_once_within_the_limits(lens, max_seqs, max_tokens):
    plan = plan_micro_batches(lens, max_seqs, max_tokens)
    flat = [i for mb in plan for i in mb]
    assert sorted(flat) == list(range(len(lens)))
    assert [lens[i] for i in flat] == sorted(lens)  # shortest first
    for mb in plan:
        assert 1 <= len(mb) <= max_seqs
        if max_tokens is not None and len(mb) > 1:
            assert len(mb) * max(lens[i] for i in mb) <= max_tokens


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=0, max_size=40), st.integers(1, 4), st.integers(1, 8),
       st.one_of(st.none(), st.integers(1, 1500)))
def test_every_rank_runs_as_many_micro_batches(lens, world, max_seqs, max_tokens):
    """ZeRO-2 reduces at every backward: the ranks' micro-batch counts must agree, and together they
    still train each sequence exactly once, each rank its own share, within the limits."""
    plans = [plan_rank_micro_batches(lens, r, world, max_seqs, max_tokens) for r in range(world)]
    assert len({len(p) for p in plans}) == 1
    assert sorted(i for p in plans for mb in p for i in mb) == list(range(len(lens)))
    for r, plan in enumerate(plans):
        for mb in plan:
            assert all(i % world == r for i in mb) and len(mb) <= max_seqs
            if max_tokens is not None and len(mb) > 1:
                assert len(mb) * max(lens[i] for i in mb) <= max_tokens


def test_a_short_rank_splits_then_pads_with_empty_micro_batches():
    # rank 0 holds 4 long sequences (4 micro-batches of one under the budget), rank 1 four short ones
    lens = [100, 10, 100, 10, 100, 10, 100, 10]
    assert [len(mb) for mb in plan_rank_micro_batches(lens, 0, 2, 8, max_tokens=150)] == [1, 1, 1, 1]
    assert [len(mb) for mb in plan_rank_micro_batches(lens, 1, 2, 8, max_tokens=150)] == [1, 1, 1, 1]
    assert plan_rank_micro_batches([10, 10, 500], 1, 2, 1) == [[1], []]


def test_a_token_budget_cuts_the_padding_of_a_heavy_tail():
    lens = [20] * 28 + [60, 90, 150, 220]  # one micro-batch of 32 pads everything to 220
    by_count = plan_micro_batches(lens, 32)
    by_tokens = plan_micro_batches(lens, 32, max_tokens=640)
    assert padded_tokens(lens, by_count) == 32 * 220
    assert [len(mb) for mb in by_tokens] == [28, 3, 1]  # 29 x 60 and 4 x 220 would pass 640
    assert padded_tokens(lens, by_tokens) == 28 * 20 + 3 * 150 + 220
    assert plan_micro_batches([500], 4, max_tokens=100) == [[0]]  # longer than the budget: alone


def test_plan_rejects_bad_limits():
    with pytest.raises(ValueError, match="max_seqs: expected >= 1"):
        plan_micro_batches([1, 2], 0)
    with pytest.raises(ValueError, match="max_tokens: expected >= 1 or None"):
        plan_micro_batches([1, 2], 2, 0)


def test_trainer_config_names_the_field():
    from splash_rollout.recipes.grpo.trainer import TrainerConfig

    with pytest.raises(ValueError, match="trainer.micro_batch_tokens: expected an integer >= 1 or null"):
        TrainerConfig(micro_batch_tokens=0)


def test_grpo_update_is_the_same_step_however_it_is_split():
    """The loss divides by the whole step's normaliser, so splitting by tokens leaves the summed loss
    and the gradient (its norm) as they are with one micro-batch."""
    import torch.distributed as dist

    from splash_rollout.recipes.grpo.loss import GRPOLossConfig
    from splash_rollout.recipes.grpo.trainer import Trainer, TrainerConfig
    from splash_rollout.recipes.grpo.update import UpdateConfig, grpo_update
    from splash_rollout import EngineConfig, RolloutEngine, SamplingParams
    from splash_rollout.models.config import PRESETS
    from splash_rollout.models.model import MLAForCausalLM
    from splash_rollout.rollout.types import RolloutBatch, SampleGroup

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    was = dist.is_initialized()
    try:
        prompts = [[5, 6, 7, 8] * 3, [9, 10, 11]]
        lengths = [SamplingParams(n=3, max_new_tokens=m, seed=3, ignore_eos=True) for m in (4, 24)]
        with RolloutEngine(EngineConfig(model="glm5-nano", num_pages=64, page_size=8)) as engine:
            batch = engine.generate(prompts, lengths)
        groups = [SampleGroup(i, g.samples) for i, g in enumerate(batch.groups)]
        advantages = torch.tensor([[1.0, -0.5, -0.5], [0.3, -1.0, 0.7]])
        stats = {}
        for name, tokens in (("one", None), ("split", 40)):
            model = MLAForCausalLM.from_config(PRESETS["glm5-nano"], seed=0)
            trainer = Trainer(model, TrainerConfig(backend="torch", lr=1e-4, grad_clip=0.0))
            config = UpdateConfig(GRPOLossConfig(), micro_batch_size=64, micro_batch_tokens=tokens, max_new_tokens=24)
            stats[name] = grpo_update(trainer, RolloutBatch(groups), advantages, config, pad_id=0, step=0)
        assert stats["one"]["train/loss"] == pytest.approx(stats["split"]["train/loss"], rel=1e-5, abs=1e-7)
        assert stats["one"]["train/grad_norm"] == pytest.approx(stats["split"]["train/grad_norm"], rel=1e-5)
        assert stats["one"]["train/grad_norm"] > 0
    finally:
        torch.set_num_threads(threads)
        if not was and dist.is_initialized():
            dist.destroy_process_group()
