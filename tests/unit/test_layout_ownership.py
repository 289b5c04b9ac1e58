"""The ownership model: layouts, byte counts, footprints and fit rules (paper §2, Table 2, Table 3)."""
import numpy as np
import pytest

from splash_rollout.layout import (ALL_LAYOUTS, AttentionBytes, GiB, Layout, Ownership, Placement,
                                   RankBudget, div_even, fits, footprints, rank_demand)
from splash_rollout.models.config import PRESETS


def test_layouts_are_the_four_pairs():
    pairs = {(l.placement, l.ownership) for l in ALL_LAYOUTS}
    assert len(pairs) == 4
    assert (Layout.DOP.placement, Layout.DOP.ownership) == (Placement.SHARDED, Ownership.OWNER)
    assert (Layout.TP.placement, Layout.TP.ownership) == (Placement.SHARDED, Ownership.EVERY)
    assert (Layout.CP.placement, Layout.CP.ownership) == (Placement.REPLICATED, Ownership.POSITIONS)
    assert (Layout.DP.placement, Layout.DP.ownership) == (Placement.REPLICATED, Ownership.OWNER)
    assert Layout.parse("DOP") is Layout.DOP
    with pytest.raises(ValueError, match="layout: unknown layout 'sp'"):
        Layout.parse("sp")


def test_div_even_explains_itself():
    assert div_even(64, 8) == 8
    with pytest.raises(ValueError, match="a = 64 must be divisible by b = 3"):
        div_even(64, 3)


def test_kv_bytes_per_token_match_the_paper():
    # Appendix B: DeepSeek-V3.2 in FP8 stores 48,068 bytes per token over 61 layers (656 B FlashMLA
    # latent+rope and 132 B indexer key per layer).
    assert AttentionBytes.from_model(PRESETS["deepseek-v3.2"]).kv_bytes_per_token_total == 48_068
    # GLM-5 (78 layers) at the same 788 B per layer: 61,464 B per token.
    glm = AttentionBytes.from_model(PRESETS["glm-5"])
    assert glm.kv_bytes_per_token_total == 61_464
    # DeepSeek-V3 has no indexer: 656 B per layer.
    assert AttentionBytes.from_model(PRESETS["deepseek-v3"]).kv_bytes_per_token[0] == 656
    assert AttentionBytes.from_model(PRESETS["deepseek-v3"], kv_format="bf16").kv_bytes_per_token[0] == 576 * 2


@pytest.mark.parametrize("tokens,gib", [(1_045_312, 59.84), (8_271_360 // 8, 59.19), (6_497_792 // 8, 46.50),
                                         (632_512, 36.21), (4_731_904 // 8, 33.86)])
def test_table3_gib_per_card_equals_pool_tokens_times_glm_kv_bytes(tokens, gib):
    # Table 3 lists GiB per card and distinct tokens; at 61,464 B/token the two agree to the
    # table's rounding (0.01 GiB), so the table's pools are whole-model KV of GLM-5-shaped layers.
    assert tokens * 61_464 / GiB == pytest.approx(gib, abs=0.01)


def test_w_a_counts_q_b_kv_b_o_with_fp8_block_scales():
    c = PRESETS["glm-5"]
    per_layer = (2048 * 64 * 256 + 512 * 64 * (192 + 256) + 64 * 256 * 6144)
    scales = (128 * 16 + 224 * 4 + 48 * 128) * 4
    sizes = AttentionBytes.from_model(c, "fp8")
    assert sizes.switchable_weight_bytes[0] == per_layer + scales
    assert AttentionBytes.from_model(c, "bf16").switchable_weight_bytes[0] == 2 * per_layer


@pytest.mark.parametrize("model", ["glm-5", "deepseek-v3.2", "deepseek-v3", "kimi-k2"])
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_dop_gains_w_a_times_one_minus_one_over_t_over_dp(model, world_size):
    sizes = AttentionBytes.from_model(PRESETS[model])
    budget = RankBudget.from_gib(141, 0.9)
    fps = footprints(sizes, world_size, budget, page_size=1)
    room = {l: budget.attention_bytes - fp.weight_bytes_per_rank for l, fp in fps.items()}
    assert room[Layout.DOP] - room[Layout.DP] == pytest.approx(sizes.w_a * (1 - 1 / world_size), abs=1)
    kv = sizes.kv_bytes_per_token_total
    assert fps[Layout.DOP].pool_tokens_per_rank - fps[Layout.DP].pool_tokens_per_rank == pytest.approx(
        sizes.w_a * (1 - 1 / world_size) / kv, abs=1)
    # TP shares DOP's weights, CP shares DP-attention's; TP's group holds one copy.
    assert fps[Layout.TP].pool_tokens_per_rank == fps[Layout.DOP].pool_tokens_per_rank
    assert fps[Layout.CP].pool_tokens_per_rank == fps[Layout.DP].pool_tokens_per_rank
    assert fps[Layout.TP].distinct_tokens == fps[Layout.TP].pool_tokens_per_rank
    assert fps[Layout.DOP].distinct_tokens == world_size * fps[Layout.DOP].pool_tokens_per_rank


def test_pool_is_whole_pages_and_zero_when_weights_fill_memory():
    sizes = AttentionBytes.from_model(PRESETS["glm-5"])
    fps = footprints(sizes, 8, RankBudget.from_gib(80, 0.9), page_size=64)
    assert all(fp.pool_tokens_per_rank % 64 == 0 for fp in fps.values())
    tiny = footprints(sizes, 8, RankBudget.from_gib(4, 1.0), page_size=64)
    assert tiny[Layout.DP].pool_tokens_per_rank == 0 and tiny[Layout.DOP].pool_tokens_per_rank > 0


def test_rank_budget_rejects_bad_values():
    with pytest.raises(ValueError, match="memory_gib"):
        RankBudget.from_gib(-1)
    with pytest.raises(ValueError, match="mem_fraction"):
        RankBudget.from_gib(80, 1.5)


def test_fit_rules():
    lengths = [100, 100, 100, 60]
    t = 2
    # TP: every rank holds every history.
    assert fits(Layout.TP, lengths, 360, t) and not fits(Layout.TP, lengths, 359, t)
    # CP: ceil(sum / T) per rank.
    assert fits(Layout.CP, lengths, 180, t) and not fits(Layout.CP, lengths, 179, t)
    # DP / DOP: round-robin owners 0,1,0,1 -> owner 0 holds 200, owner 1 holds 160.
    for layout in (Layout.DP, Layout.DOP):
        assert fits(layout, lengths, 200, t) and not fits(layout, lengths, 199, t)
    # explicit owners move the busiest rank
    assert rank_demand(Layout.DOP, np.array(lengths), t, owners=np.array([0, 0, 0, 1])) == 300


def test_rank_demand_vectorises_over_cohorts():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 1000, size=(50, 7))
    for layout in ALL_LAYOUTS:
        batched = rank_demand(layout, lengths, 3)
        one_by_one = [rank_demand(layout, row, 3) for row in lengths]
        assert batched.tolist() == [int(x) for x in one_by_one]
