"""Reproducible numerics (models/numerics.py): a token's logprob does not depend on how it was batched,
and the engine's rollout logprobs equal the trainer's. Exactness, not a tolerance: fast float32
kernels leave the same comparisons 1e-7..3e-5 apart (shape-dependent rounding), which these tests
would catch."""
import pytest
import torch

from splash_rollout.recipes.grpo.loss import token_logprobs
from splash_rollout.recipes.grpo.trainer import collate
from splash_rollout import EngineConfig, RolloutEngine, SamplingParams
from splash_rollout.models.config import resolve_model
from splash_rollout.models.model import MLAForCausalLM
from splash_rollout.models.numerics import numerics, numerics_mode, set_numerics


def sharp_model(steps: int = 20, lr: float = 6e-3) -> MLAForCausalLM:
    """glm5-nano after a few AdamW steps on periodic sequences: confident logits, larger activations
    (the regime where one ulp of difference reaches 1e-5 of logprob)."""
    model = MLAForCausalLM.from_config(resolve_model("glm5-nano"), seed=0)
    base = torch.randint(3, 40, (8, 12), generator=torch.Generator().manual_seed(1))
    data = base.repeat(1, 6)  # [8, 72]: longer than the indexer's top-64, so DSA selection runs
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        logits = model(data)[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def model():
    return sharp_model()


@pytest.fixture
def reproducible():
    with numerics("reproducible"):
        yield


def test_modes_are_validated_and_the_context_restores_the_previous_one():
    with pytest.raises(ValueError, match="numerics: expected one of"):
        set_numerics("float64")
    with pytest.raises(ValueError, match="numerics"):
        EngineConfig(numerics="exact")
    assert numerics_mode() == "fast"
    with numerics("reproducible"):
        assert numerics_mode() == "reproducible"
    assert numerics_mode() == "fast"


def test_logprobs_do_not_depend_on_batch_padding_or_sequence_length(model, reproducible):
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(3, 60, (n,), generator=gen).tolist() for n in (70, 9, 47, 33, 81, 5)]
    batch = collate([s[:1] for s in seqs], [s[1:] for s in seqs], pad_id=2)
    with torch.no_grad():
        together = token_logprobs(model(batch.input_ids, batch.attention_mask)[:, :-1], batch.targets)
        for i, s in enumerate(seqs):
            ids = torch.tensor([s])
            alone = token_logprobs(model(ids)[:, :-1], ids[:, 1:])[0]
            assert torch.equal(alone, together[i, : len(s) - 1]), i
            # a prefix of the sequence scores its positions exactly like the whole sequence does
            cut = len(s) // 2 + 1
            prefix = token_logprobs(model(ids[:, :cut])[:, :-1], ids[:, 1:cut])[0]
            assert torch.equal(prefix, alone[: cut - 1]), i


def test_engine_logprobs_equal_trainer_logprobs_exactly(model, reproducible):
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11], [12] * 30, [40, 41] * 12, [3, 4], [7] * 9]
    config = EngineConfig(model="glm5-nano", num_pages=128, page_size=8, max_num_batched_tokens=64,
                          numerics="reproducible")
    with RolloutEngine(config) as engine:
        engine.update_weights(weights, version=1)
        batch = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=48, seed=7,
                                                        ignore_eos=True))
    samples = batch.samples
    mb = collate([s.prompt_ids for s in samples], [s.response_ids for s in samples], pad_id=0,
                 per_token={"rollout": [s.response_logprobs for s in samples]})
    with torch.no_grad():
        trainer = token_logprobs(model(mb.input_ids, mb.attention_mask)[:, :-1], mb.targets)
    mask = mb.loss_mask.bool()
    assert int(mask.sum()) == 24 * 48
    diff = (trainer - mb.extras["rollout"])[mask].abs()
    assert float(diff.max()) <= 1e-6, float(diff.max())  # a rare 1-2 ulp flip; fast kernels: up to 3e-5
