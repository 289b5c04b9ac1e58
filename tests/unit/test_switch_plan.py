"""SwitchPlan: the 12-way manifest, its primitives and its byte counts (paper §2, Figure 3)."""

import numpy as np
import pytest

from splash_rollout.layout import (AttentionBytes, BatchKV, Layout, Primitive, SwitchPlan,
                                   all_switches)
from splash_rollout.layout.switch_plan import cp_tokens_on_rank
from splash_rollout.models.config import PRESETS

GLM = AttentionBytes.from_model(PRESETS["glm-5"])


def test_twelve_directions_and_their_primitives():
    plans = all_switches(GLM, BatchKV.uniform(16, 4096, 8), 8)
    assert len(plans) == 12
    assert len({(p.src, p.dst) for p in plans}) == 12
    gathers = {(p.src, p.dst) for p in plans if p.weights_primitive is Primitive.ALL_GATHER}
    assert gathers == {(Layout.TP, Layout.DP), (Layout.TP, Layout.CP), (Layout.DOP, Layout.DP), (Layout.DOP, Layout.CP)}
    kv_collectives = [p for p in plans if p.kv_primitive.moves_bytes]
    assert len(kv_collectives) == 7
    free = {(p.src, p.dst) for p in plans if not p.network}
    assert free == {(Layout.TP, Layout.DOP), (Layout.DP, Layout.DOP)}
    for p in plans:
        if not p.network:
            assert p.max_bytes_received == 0 and max(p.bytes_sent_per_rank) == 0
    both = [(p.src, p.dst) for p in plans if p.weights_primitive.moves_bytes and p.kv_primitive.moves_bytes]
    assert both == [(Layout.DOP, Layout.CP)]


def test_weight_all_gather_moves_one_minus_one_over_t_of_each_layer():
    plan = SwitchPlan.build("dop", "dp", GLM, BatchKV.uniform(4, 1000, 8), 8)
    layer = GLM.switchable_weight_bytes[0]
    assert plan.layers[0].weights.bytes_received == (layer * 7 // 8,) * 8
    assert plan.max_bytes_received == GLM.w_a * 7 // 8
    assert plan.kv_primitive is Primitive.KEEP


def test_cp_pages_go_round_robin():
    # page size 2: a 5-token history has pages of 2, 2, 1 tokens on ranks 0, 1, 0
    assert cp_tokens_on_rank(np.array([5, 3]), 2, 2).tolist() == [[3, 2], [2, 1]]
    assert cp_tokens_on_rank(np.array([0, 8]), 4, 2).tolist() == [[0, 2]] * 4


def _kv_tokens(plan, per_token):
    sent = [b // per_token for b in plan.layers[0].kv.bytes_sent]
    received = [b // per_token for b in plan.layers[0].kv.bytes_received]
    return sent, received


@pytest.mark.parametrize("src,dst,sent,received", [
    ("dp", "cp", [2, 2], [2, 2]),   # each owner ships the pages the other rank stores under CP
    ("cp", "dp", [2, 2], [2, 2]),
    ("dp", "tp", [5, 3], [3, 5]),   # each rank receives the other owner's whole history
    ("cp", "tp", [5, 3], [3, 5]),   # rank 0 holds 3+2 tokens, rank 1 holds 2+1
    ("dop", "cp", [2, 2], [2, 2]),
    ("tp", "cp", [0, 0], [0, 0]),   # discard
])
def test_kv_bytes_by_hand(src, dst, sent, received):
    batch = BatchKV(lengths=(5, 3), owners=(0, 1), page_size=2)
    plan = SwitchPlan.build(src, dst, GLM, batch, 2)
    assert _kv_tokens(plan, GLM.kv_bytes_per_token[0]) == (sent, received)


@pytest.mark.parametrize("seed", range(5))
def test_every_byte_sent_is_received_and_reverse_switches_mirror(seed):
    rng = np.random.default_rng(seed)
    t = int(rng.choice([2, 4, 8]))
    b = int(rng.integers(1, 20))
    batch = BatchKV(tuple(int(x) for x in rng.integers(0, 5000, b)),
                    tuple(int(x) for x in rng.integers(0, t, b)), page_size=int(rng.choice([1, 16, 64])))
    plans = {(p.src, p.dst): p for p in all_switches(GLM, batch, t)}
    for (src, dst), p in plans.items():
        assert sum(p.bytes_sent_per_rank) == sum(p.bytes_received_per_rank)
        if p.kv_primitive is Primitive.ALL_TO_ALL:
            back = plans[(dst, src)]
            assert back.kv_bytes_received_per_rank == tuple(
                sum(l.kv.bytes_sent[r] for l in p.layers) for r in range(t))
    # Eq. 5 headroom is one layer's incoming buffers on the busiest rank
    p = plans[(Layout.DOP, Layout.CP)]
    assert p.layer_buffer_bytes == max(max(l.bytes_received) for l in p.layers)


def test_same_layout_is_rejected():
    with pytest.raises(ValueError, match="dst: a switch needs two different layouts"):
        SwitchPlan.build("tp", "tp", GLM, BatchKV.uniform(1, 1, 2), 2)


def test_indexer_keys_move_with_kv():
    v3 = AttentionBytes.from_model(PRESETS["deepseek-v3"])
    v32 = AttentionBytes.from_model(PRESETS["deepseek-v3.2"])
    batch = BatchKV.uniform(4, 1024, 4)
    a = SwitchPlan.build("dp", "tp", v3, batch, 4).max_bytes_received
    b = SwitchPlan.build("dp", "tp", v32, batch, 4).max_bytes_received
    assert b / a == pytest.approx(788 / 656)
