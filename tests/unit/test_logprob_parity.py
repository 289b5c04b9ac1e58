"""After update_weights with trained weights, the engine's rollout logprobs equal the trainer's
logprobs of the same tokens (float32, 1e-5), with temperature 1 and top_p < 1: the rollout logprob
is that of the untruncated distribution, which is what the trainer's forward computes. Fast numerics
on a lightly trained model; test_numerics.py checks reproducible numerics to exactness."""
import torch

from splash_rollout.recipes.grpo.loss import token_logprobs
from splash_rollout.recipes.grpo.trainer import collate
from splash_rollout import EngineConfig, RolloutEngine, SamplingParams
from tests.unit.test_numerics import sharp_model


def test_engine_logprobs_equal_trainer_logprobs_after_update_weights():
    model = sharp_model()
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11], [12] * 30, [40, 41] * 12]
    with RolloutEngine(EngineConfig(model="glm5-nano", num_pages=128, page_size=8, max_num_batched_tokens=64)) as engine:
        engine.update_weights(weights, version=1)
        batch = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, top_p=0.8, max_new_tokens=24, seed=7,
                                                        ignore_eos=True))
    samples = batch.samples
    assert all(s.weight_version == 1 for s in samples)
    mb = collate([s.prompt_ids for s in samples], [s.response_ids for s in samples], pad_id=0,
                 per_token={"rollout": [s.response_logprobs for s in samples]})
    with torch.no_grad():
        trainer = token_logprobs(model(mb.input_ids, mb.attention_mask)[:, :-1], mb.targets, 1.0)
    mask = mb.loss_mask.bool()
    diff = (trainer - mb.extras["rollout"])[mask].abs()
    assert int(mask.sum()) == 16 * 24
    assert float(diff.max()) <= 1e-5, float(diff.max())
    # top_p truncated the sampling distribution, not the reported logprobs: they are not renormalised
    assert float(mb.extras["rollout"][mask].exp().max()) < 1.0
