"""Reproducible numerics over two ranks: whatever layout computes a token (TP's and DOP's head-sharded
o_proj, CP's partial attention over a split history, the feed-forward block sharded over the ranks
or replicated on each) and across live switches, its rollout logprob equals the trainer's
single-process one: bit-identical on almost every token, a rare value that lands within float64
noise of a float32 rounding boundary one or two ulps apart (measured: 0-4 of 2816 tokens per
layout, at most 4.8e-7)."""
import pytest
import torch

from splash_rollout.recipes.grpo.loss import token_logprobs
from splash_rollout.recipes.grpo.trainer import collate
from splash_rollout import EngineConfig, RolloutEngine, SamplingParams
from splash_rollout.models.numerics import numerics
from tests.unit.test_numerics import sharp_model


@pytest.mark.parametrize("feed_forward", ["sharded", "replicated"])
def test_every_layout_and_switch_reproduces_the_trainers_logprobs(feed_forward):
    model = sharp_model()
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11], [12] * 30, [40, 41] * 12]
    config = EngineConfig(model="glm5-nano", world_size=2, layout="tp", num_pages=64, page_size=8,
                          max_num_batched_tokens=64, numerics="reproducible",
                          switch_schedule={6: "cp", 18: "dop", 30: "dp"}, feed_forward=feed_forward)
    with RolloutEngine(config) as engine:
        engine.update_weights(weights, version=1)
        batch = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=44, seed=5,
                                                        ignore_eos=True))
        held = [rank["weights"] for rank in engine.memory_stats()]
    served = {name: p for name, p in model.named_parameters() if not name.startswith("model.mtp_layers.")}  # no MTP
    ff_bytes = sum(p.nbytes for name, p in served.items() if ".mlp." in name and ".mlp.gate." not in name)
    other_bytes = sum(p.nbytes for p in served.values()) - ff_bytes  # the routers are replicated either way
    ff_per_rank = ff_bytes if feed_forward == "replicated" else ff_bytes // 2  # whole blocks, or half of them
    assert all(abs(h - other_bytes - ff_per_rank) < 1024 for h in held), (held, other_bytes, ff_per_rank)
    assert [p["layout"] for p in batch.timeline.to_dict()["phases"]] == ["tp", "cp", "dop", "dp"]
    samples = batch.samples
    mb = collate([s.prompt_ids for s in samples], [s.response_ids for s in samples], pad_id=0,
                 per_token={"rollout": [s.response_logprobs for s in samples]})
    with numerics("reproducible"), torch.no_grad():
        trainer = token_logprobs(model(mb.input_ids, mb.attention_mask)[:, :-1], mb.targets)
    mask = mb.loss_mask.bool()
    assert int(mask.sum()) == 8 * 44
    diff = (trainer - mb.extras["rollout"])[mask].abs()
    assert float(diff.max()) <= 1e-6, float(diff.max())  # a rare 1-2 ulp flip; fast kernels: up to 3e-5
