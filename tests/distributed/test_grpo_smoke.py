"""GRPO end to end, tiny: two steps through run.py's code path (composed Hydra config -> launch),
on 2 spawned gloo ranks (DeepSpeed ZeRO-2 over both), and the engine/trainer logprob contract."""
import json
import os

import pytest
import torch

from tests.pinned_profile import PINNED_PROFILE

pytestmark = pytest.mark.usefixtures("no_leftover_process_group")

REQUIRED = ("step", "reward/mean", "rollout/response_len/mean", "perf/tokens_per_s", "layout/switches",
            "train/loss", "train/clip_frac", "train/grad_norm", "timing_s/rollout", "mtp/loss", "mtp/accept_top1",
            "mtp/accept_coupled")
TINY = ["+recipe=grpo_glm5", "sft.steps=2", "sft.batch_size=8", "sft.warmup_steps=1", "grpo.steps=2",
        "grpo.prompts_per_step=4", "grpo.n=4", "grpo.max_new_tokens=16", "trainer.micro_batch_size=8",
        "logger.kind=none", "hardware.threads=1", "eval.every=0"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_grpo_steps_on_two_ranks_across_a_scheduler_switch(tmp_path):
    """Two GRPO steps on 2 spawned ranks. At 2 MiB per rank DP-attention's pool holds 4 of the 16
    requests and DOP's all of them: the policy moves the engine out of DP-attention in step 0, the
    trainer's weights are then pushed into the switched layout, and step 1 samples them with the
    trainer's logprobs."""
    from splash_rollout.run import compose_config, launch

    # θ pinned (tests/pinned_profile.py), uncorrected: the correction follows this machine's step
    # times, and with them the machine's load, while this test pins what capacity decides
    launch(compose_config(TINY + ["engine.parallel.world_size=2", "engine.memory.memory_budget_gib=0.002",
                                  "engine.pricing.online_correction=false", f"engine.pricing.profile={PINNED_PROFILE}"]),
           str(tmp_path))
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and [l["step"] for l in lines] == [0, 1]
    for line in lines:
        assert all(k in line for k in REQUIRED), set(REQUIRED) - set(line)
        assert line["rollout/num_samples"] == 16
    # step 0 trains on the pushed SFT weights, step 1 on those pushed after step 0: under the recipe's
    # reproducible numerics the trainer's on-policy forward reproduces the engine's logprobs
    assert all(line["train/logprob_diff_max"] <= 1e-6 for line in lines), [l["train/logprob_diff_max"] for l in lines]
    for name in ("timeline.json", "timeline.png", "samples.jsonl", "summary.json"):
        assert (tmp_path / name).exists(), name
    steps = json.loads((tmp_path / "timeline.json").read_text())["steps"]
    assert len(steps) == 2
    first = steps[0]
    assert [(s["src"], s["dst"], s["deferred_reason"]) for s in first["switches"]] == [("dp", "dop", None)]
    assert first["decisions"][0]["chosen"] == "dop" and first["decisions"][0]["admitted"]["dop"] == 16
    assert first["decisions"][0]["admitted"]["dp"] < 16
    assert steps[1]["phases"][0]["layout"] == "dop"
    assert [l["layout/switches"] for l in lines] == [1.0, 0.0]


@pytest.mark.slow
def test_engine_logprobs_equal_trainer_logprobs_after_push(tmp_path):
    from splash_rollout.recipes.grpo.loop import build_engine, build_policy
    from splash_rollout.recipes.grpo.trainer import Trainer, TrainerConfig, collate
    from splash_rollout.rollout.types import SamplingParams
    from splash_rollout.run import compose_config

    cfg = compose_config(TINY)
    trainer = Trainer(build_policy(cfg), TrainerConfig(backend="torch", lr=1e-2), temperature=0.7)
    engine = build_engine(cfg)
    # one optimizer step moves the weights away from the engine's initial ones
    mb = collate([[5, 6, 7]], [[8, 9]], pad_id=2)
    trainer.optimizer_step([mb], lambda lp, b: (-(lp * b.loss_mask).sum(), {}), temperature=1.0)
    engine.update_weights(trainer.named_weights(), version=1)
    batch = engine.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(n=2, temperature=0.7, max_new_tokens=20,
                                                                    seed=3, ignore_eos=True))
    samples = batch.samples
    b = collate([s.prompt_ids for s in samples], [s.response_ids for s in samples], pad_id=2,
                per_token={"engine": [s.response_logprobs for s in samples]})
    mine = trainer.logprobs(b)
    mask = b.loss_mask > 0
    assert mask.sum() == 4 * 20
    torch.testing.assert_close(mine[mask], b.extras["engine"][mask], atol=1e-5, rtol=0)
    engine.shutdown()


SEQS = ([[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42]], [[13, 14, 15, 16, 17], [50, 51]])
"""(prompts, responses): rank 0 trains on sample 0, rank 1 on sample 1. The short sample routes its 2
tokens to at most 4 of glm5-nano's 8 experts per layer, so the two ranks use different expert sets."""


def _global_token_mean_loss(normalizer):
    def loss_fn(lp, b):
        return -(lp * b.loss_mask).sum() / normalizer, {}
    return loss_fn


def _zero2_rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from splash_rollout.recipes.grpo.trainer import Trainer, TrainerConfig, collate
    from splash_rollout.models.config import PRESETS
    from splash_rollout.models.model import MLAForCausalLM

    trainer = Trainer(MLAForCausalLM.from_config(PRESETS["glm5-nano"], seed=0),
                      TrainerConfig(backend="deepspeed", zero_stage=2, lr=1e-3), rank=rank, world_size=2)
    mb = collate([SEQS[0][rank]], [SEQS[1][rank]], pad_id=2)
    stats = trainer.optimizer_step([mb], _global_token_mean_loss(sum(len(r) for r in SEQS[1]) / 2), 1.0)
    torch.save({"grad_norm": stats["grad_norm"], "weights": trainer.named_weights()}, f"{out}.{rank}")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_zero2_on_two_ranks_matches_one_rank(tmp_path):
    """Same optimizer step whether the batch is split over 2 ZeRO-2 ranks or run whole on one
    (checks the gradient bucket order with MoE ranks using different experts, and the normalizer)."""
    import torch.multiprocessing as mp

    from splash_rollout.recipes.grpo.trainer import Trainer, TrainerConfig, collate
    from splash_rollout.distributed.launch import free_port
    from splash_rollout.models.config import PRESETS
    from splash_rollout.models.model import MLAForCausalLM

    out = str(tmp_path / "w")
    mp.spawn(_zero2_rank, args=(free_port(), out), nprocs=2, join=True)
    got = [torch.load(f"{out}.{r}") for r in range(2)]
    ref = Trainer(MLAForCausalLM.from_config(PRESETS["glm5-nano"], seed=0), TrainerConfig(backend="torch", lr=1e-3))
    mb = collate(SEQS[0], SEQS[1], pad_id=2)
    stats = ref.optimizer_step([mb], _global_token_mean_loss(sum(len(r) for r in SEQS[1])), 1.0)
    assert got[0]["grad_norm"] == pytest.approx(stats["grad_norm"], rel=1e-4)
    # Adam's first step is ~lr * sign(g): elements whose gradient is ~eps amplify float rounding, so
    # allow rare small deviations; a mismatched bucket order would move whole tensors by ~lr (1e-3)
    for name, w in ref.named_weights().items():
        torch.testing.assert_close(got[0]["weights"][name], got[1]["weights"][name], atol=0, rtol=0)
        d = (got[0]["weights"][name] - w).abs()
        assert float(d.max()) < 5e-5 and float((d > 1e-6).float().mean()) < 1e-3, name


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_plain_torch_trainer_on_two_ranks_keeps_the_replicas_in_step(tmp_path):
    """trainer=torch all-reduces every trainable parameter on every rank, also an MoE expert that got
    no token on one of them (a missing gradient there would mismatch the collective after step 0);
    the replicas then stay equal, so the engine's shards of step 2 sample the trainer's logprobs."""
    from splash_rollout.run import compose_config, launch

    launch(compose_config(TINY + ["engine.parallel.world_size=2", "trainer=torch", "grpo.steps=3"]), str(tmp_path))
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [l["grpo_step"] for l in lines] == [0, 1, 2]
    assert all(l["train/logprob_diff_max"] <= 1e-6 for l in lines), [l["train/logprob_diff_max"] for l in lines]


UNEVEN = ([[5, 6, 7], [40, 41], [13, 14, 15], [50, 51]],
          [[8, 9, 10, 11, 12, 16, 17, 18, 19, 20], [42, 43], [21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [52]])
"""(prompts, responses) of 4 samples: rank 0 trains samples 0 and 2 (13 tokens each), rank 1 samples
1 and 3 (4 and 3 tokens). Under a 16-token budget rank 0 needs two micro-batches, rank 1 one."""


def _zero2_uneven_rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from splash_rollout.recipes.grpo.micro_batches import plan_rank_micro_batches
    from splash_rollout.recipes.grpo.trainer import Trainer, TrainerConfig, collate
    from splash_rollout.models.config import PRESETS
    from splash_rollout.models.model import MLAForCausalLM

    trainer = Trainer(MLAForCausalLM.from_config(PRESETS["glm5-nano"], seed=0),
                      TrainerConfig(backend="deepspeed", zero_stage=2, lr=1e-3), rank=rank, world_size=2)
    prompts, responses = UNEVEN
    plan = plan_rank_micro_batches([len(p) + len(r) for p, r in zip(*UNEVEN)], rank, 2, max_seqs=8, max_tokens=16)
    micro = [collate([prompts[i] for i in ids], [responses[i] for i in ids], pad_id=2) for ids in plan]
    normalizer = sum(len(r) for r in responses) / 2
    stats = trainer.optimizer_step(micro, _global_token_mean_loss(normalizer), 1.0)
    torch.save({"grad_norm": stats["grad_norm"], "micro_batches": len(micro)}, f"{out}.{rank}")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_zero2_ranks_run_as_many_micro_batches_under_a_token_budget(tmp_path):
    """ZeRO-2 reduces gradients at every backward, so the rank whose share fits one micro-batch splits
    it to match the other's two; the step is then the one-rank step of the whole batch."""
    import torch.multiprocessing as mp

    from splash_rollout.recipes.grpo.trainer import Trainer, TrainerConfig, collate
    from splash_rollout.distributed.launch import free_port
    from splash_rollout.models.config import PRESETS
    from splash_rollout.models.model import MLAForCausalLM

    out = str(tmp_path / "w")
    mp.spawn(_zero2_uneven_rank, args=(free_port(), out), nprocs=2, join=True)
    got = [torch.load(f"{out}.{r}") for r in range(2)]
    assert [g["micro_batches"] for g in got] == [2, 2]
    ref = Trainer(MLAForCausalLM.from_config(PRESETS["glm5-nano"], seed=0), TrainerConfig(backend="torch", lr=1e-3))
    stats = ref.optimizer_step([collate(*UNEVEN, pad_id=2)],
                               _global_token_mean_loss(sum(len(r) for r in UNEVEN[1])), 1.0)
    assert got[0]["grad_norm"] == pytest.approx(stats["grad_norm"], rel=1e-4)
