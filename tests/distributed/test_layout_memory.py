"""Per-rank resident bytes follow the ownership model, and DOP's bigger pool admits more."""
import pytest
import torch

from splash_rollout.layout import Layout, RankBudget, footprints, other_weight_bytes_per_rank
from splash_rollout.engine.rank_engine import sizes_for
from tests.distributed.layout_cases import MODELS, PAGE_SIZE, memory_report

BUDGET = 6 << 20  # 6 MiB per rank for attention weights + KV


@pytest.fixture(scope="module")
def reports(group2):
    return {l: group2.run(memory_report, "glm5-nano", l, BUDGET) for l in ("tp", "dp", "dop", "cp")}


def test_resident_bytes_equal_the_ownership_model(reports):
    sizes = sizes_for(MODELS["glm5-nano"], torch.float32)
    model = footprints(sizes, 2, RankBudget(BUDGET), page_size=PAGE_SIZE)
    for name, per_rank in reports.items():
        fp = model[Layout(name)]
        for rank in per_rank:
            assert rank["switchable"] + rank["replicated_attention"] == fp.weight_bytes_per_rank, name
            assert rank["switchable"] == (sizes.w_a // 2 if Layout(name).shards_projections else sizes.w_a)
            assert rank["kv_pool"] == fp.pool_bytes_per_rank, name
            assert rank["pool_tokens"] == fp.pool_tokens_per_rank, name
            # every weight the rank holds: the footprint CLI's prediction (feed-forward sharded, vocab replicated)
            assert rank["weights"] == fp.weight_bytes_per_rank + other_weight_bytes_per_rank(
                MODELS["glm5-nano"], 2, "fp32", "sharded", "replicated"), name


def test_dop_pool_beats_dp_by_the_predicted_ratio_and_admits_more(reports):
    sizes = sizes_for(MODELS["glm5-nano"], torch.float32)
    dop, dp = reports["dop"][0], reports["dp"][0]
    extra_tokens = (dop["pool_tokens"] - dp["pool_tokens"])
    assert extra_tokens == pytest.approx(sizes.w_a / 2 / sizes.kv_bytes_per_token_total, abs=PAGE_SIZE)
    assert dop["admitted"] > dp["admitted"] >= 1
