"""Speculative decoding on 2 ranks: in every layout and through live switches between them, with
``speculation="always"`` the samples equal one rank's without speculation: the same tokens and
finish reasons, and under reproducible numerics the same logprobs up to its one caveat -- a float64
sum that lands within ~1e-16 of a float32 rounding boundary may round either way when the rows
around it change (here: the routed experts' products over the drafted rows); measured, one logprob
in 480 one float32 ulp (4.8e-7) apart. Drafts are proposed by every rank's scheduler replica from the
same tokens, so the replicas verify the same rows."""
import random

import pytest

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9] * 4, [11, 12, 13] * 6, [3] * 10, [4, 5] * 3]
PARAMS = [SamplingParams(n=4, temperature=0.0, max_new_tokens=30, ignore_eos=True),
          SamplingParams(n=4, temperature=1.0, top_k=5, max_new_tokens=30, ignore_eos=True, seed=3),
          SamplingParams(n=2, temperature=0.9, top_p=0.9, max_new_tokens=24, stop_token_ids=(7,), seed=4)]


def _outputs(batch):
    return [(s.response_ids, s.response_logprobs, s.finish_reason) for s in batch.samples]


def _assert_same(got, want):
    assert [(t, r) for t, _, r in got] == [(t, r) for t, _, r in want]
    gap = max((abs(a - b) for (_, x, _), (_, y, _) in zip(got, want) for a, b in zip(x, y)), default=0.0)
    assert gap <= 1e-6, gap


def _writes_what_one_rank_writes(engine, oracle, every_draft_from: str | None = None) -> tuple[float, float]:
    """Every PARAMS call equals the oracle's; returns (drafted tokens kept, switches) over them.
    ``every_draft_from``: a drafter other than the n-gram one (no draft may come from the group)."""
    accepted, switches = 0.0, 0.0
    for params, want in zip(PARAMS, oracle):
        batch = engine.generate(PROMPTS, params)
        _assert_same(_outputs(batch), want)
        accepted += batch.metrics["spec/accepted_tokens"]
        switches += batch.metrics["layout/switches"]
        if every_draft_from is not None:
            assert batch.metrics["spec/verified/group"] == 0  # every draft is the other source's
    return accepted, switches


@pytest.fixture(scope="module")
def oracle():
    with RolloutEngine(EngineConfig(model="glm5-nano", numerics="reproducible", page_size=4,
                                    speculation="off")) as one:
        return [_outputs(one.generate(PROMPTS, p)) for p in PARAMS]


@pytest.mark.timeout(300)
def test_every_layout_and_random_switches_write_what_one_rank_writes(oracle):
    rng = random.Random(0)
    layouts = ["tp", "dp", "dop", "cp"]
    schedule = {step: rng.choice(layouts) for step in sorted(rng.sample(range(2, 90), 12))}
    config = EngineConfig(model="glm5-nano", world_size=2, layout="dp", speculation="always", numerics="reproducible",
                          page_size=4, switch_schedule=schedule)
    with RolloutEngine(config) as engine:
        accepted, switches = _writes_what_one_rank_writes(engine, oracle)
    assert accepted > 0 and switches >= 4



@pytest.mark.timeout(300)
def test_mtp_drafts_from_rank_0_write_what_one_rank_writes_through_switches(oracle):
    """Rank 0 alone runs the MTP module; its drafts reach the other rank in the control message, so
    both verify the same rows in every layout and across live switches (the module's rows that
    DP-attention leaves on rank 1 are skipped: fewer drafts, the same tokens). The module is pushed
    (``mirror_mtp``: it drafts what a repetitive model keeps), so drafts are kept, not only rejected."""
    from splash_rollout.models.config import resolve_model
    from splash_rollout.models.model import MLAForCausalLM
    from tests.unit.test_mtp_drafter import mirror_mtp

    rng = random.Random(1)
    schedule = {step: rng.choice(["tp", "dp", "dop", "cp"]) for step in sorted(rng.sample(range(2, 90), 12))}
    config = EngineConfig(model="glm5-nano", world_size=2, layout="tp", speculation="always", draft="mtp",
                          numerics="reproducible", page_size=4, switch_schedule=schedule)
    with RolloutEngine(config) as engine:
        engine.update_weights(mirror_mtp(MLAForCausalLM.from_config(resolve_model("glm5-nano"), seed=0)), version=1)
        accepted, switches = _writes_what_one_rank_writes(engine, oracle, every_draft_from="mtp")
    assert accepted > 0 and switches >= 4
