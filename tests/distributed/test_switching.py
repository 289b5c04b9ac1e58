"""Live switching (issue 5): all 12 directions mid-batch give the tokens of the run without a switch,
and the bytes the wrappers count equal the SwitchPlan's prediction."""
from itertools import permutations

import pytest
import torch

from splash_rollout.engine.group_engine import sizes_for
from splash_rollout.layout import BatchKV, Layout, SwitchPlan
from tests.distributed.layout_cases import MODELS, PAGE_SIZE, run_switch, single_rank

DIRECTIONS = [(a.value, b.value) for a, b in permutations([Layout.TP, Layout.DP, Layout.DOP, Layout.CP], 2)]
# step 3: long prompts still in chunked prefill, short ones decoding; step 9: some requests finished
SWITCH_STEPS = [3]


@pytest.fixture(scope="module")
def oracle():
    return single_rank("glm5-nano")


def _predicted(src, dst, moves, t):
    sizes = sizes_for(MODELS["glm5-nano"], torch.float32)
    batch = BatchKV(tuple(n for n, _ in moves), tuple(o for _, o in moves), PAGE_SIZE)
    return SwitchPlan.build(src, dst, sizes, batch, t)


@pytest.mark.parametrize("src,dst", DIRECTIONS)
def test_switch_mid_batch_keeps_tokens_and_moves_the_predicted_bytes(group2, oracle, src, dst):
    results = group2.run(run_switch, "glm5-nano", src, dst, SWITCH_STEPS, timeout_s=300)
    head = results[0]
    assert head["pages_left"] == [0, 0]
    done = [r for r in head["log"] if r["deferred_reason"] is None]
    assert len(done) == 1, head["log"]
    for rid, (tokens, logprobs) in oracle.items():
        assert head["outputs"][rid][0] == tokens, f"request {rid}"
        assert max(abs(a - b) for a, b in zip(head["outputs"][rid][1], logprobs)) < 1e-4
    plan = _predicted(src, dst, done[0]["moves"], 2)
    assert [r["sent"] for r in results] == list(plan.bytes_sent_per_rank)
    assert [r["received"] for r in results] == list(plan.bytes_received_per_rank)
    if (src, dst) in {("tp", "dop"), ("dp", "dop")}:
        assert plan.max_bytes_received == 0
