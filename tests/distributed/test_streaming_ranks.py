"""Streaming generate with a filter and a target on 2 spawned ranks: the same kept, filtered and
aborted groups, and the same tokens, as on one rank."""
import torch

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams

PROMPTS = [[5 + i, 6, 7] for i in range(6)]
PARAMS = [SamplingParams(n=2, max_new_tokens=3 + 4 * i, seed=21 + i, ignore_eos=True) for i in range(6)]


def _run(world_size: int):
    # speculation off: where a stopped call cuts its samples follows the steps run, and under "auto" the
    # gate drafts where measured seconds say so (the tokens are the same, their count at the cut is not)
    with RolloutEngine(EngineConfig(model="glm5-nano", world_size=world_size, layout="dp", num_pages=128,
                                    page_size=8, max_num_batched_tokens=64, speculation="off")) as engine:
        batch = engine.generate(PROMPTS, PARAMS, on_group=lambda g: g.prompt_index != 1, target_groups=2)
        after = engine.generate(PROMPTS[:2], PARAMS[:2])  # nothing of the streamed call is left behind
    pick = lambda groups: [(g.prompt_index, [(s.response_ids, s.finish_reason) for s in g.samples]) for g in groups]
    return pick(batch.groups), pick(batch.filtered), pick(batch.aborted), pick(after.groups), batch.metrics


def test_two_ranks_stream_like_one():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = _run(1)
    finally:
        torch.set_num_threads(threads)
    two = _run(2)
    assert two[:4] == one[:4]
    assert [g for g, _ in two[0]] == [0, 2] and [g for g, _ in two[1]] == [1] and [g for g, _ in two[2]] == [3, 4, 5]
    assert two[4]["rollout/aborted_samples"] == 3 * 2 and two[4]["rollout/filtered_groups"] == 1
