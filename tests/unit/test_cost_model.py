"""Cost model t_ℓ(x; θ), hardware profiles and switch costs (pure, CPU only)."""
import math

import numpy as np
import pytest
import torch

from splash_rollout.layout import ALL_LAYOUTS, BatchKV, Layout, SwitchPlan, all_switches
from splash_rollout.scheduling import (PRESETS, Deployment, HardwareProfile, StepBatch, load_profile,
                                       overlapped_seconds, save_profile, step_time, step_times, switch_cost)
from splash_rollout.sim import sweep


@pytest.fixture(scope="module")
def glm_b200():
    return Deployment.build("glm-5", "b200")


def _uniform(b, ctx, q, t=8):
    return StepBatch.make([ctx] * b, [q] * b, np.arange(b) % t)


def _cost(dep, layout, batch, pools=None):
    return step_time(layout, batch, dep.model, dep.profile, dep.sizes, pools)


# ---- Table 2 loads ------------------------------------------------------------------------------

def test_tp_reads_every_history_owner_layouts_read_their_share(glm_b200):
    short, long_ = _uniform(16, 4096, 1), _uniform(16, 65536, 1)
    growth = {l: _cost(glm_b200, l, long_).stages["indexer"] - _cost(glm_b200, l, short).stages["indexer"]
              for l in ALL_LAYOUTS}
    # TP scans B histories per rank, CP Σs/T, DP/DOP ⌈B/T⌉ of them: 8x less at B=16, T=8
    assert growth[Layout.TP] == pytest.approx(8 * growth[Layout.DP], rel=1e-6)
    assert growth[Layout.DP] == pytest.approx(growth[Layout.DOP], rel=1e-6)
    assert growth[Layout.CP] == pytest.approx(growth[Layout.DP], rel=1e-6)


def test_sharded_layouts_read_a_slice_of_the_projections(glm_b200):
    b = _uniform(16, 4096, 1)
    proj = {l: _cost(glm_b200, l, b).stages["attn_proj"] for l in ALL_LAYOUTS}
    assert proj[Layout.TP] == pytest.approx(proj[Layout.DOP])
    assert proj[Layout.DP] > 5 * proj[Layout.DOP]  # W_A vs W_A / T, weight-read bound in decode


def test_busiest_owner_sets_owner_layout_attention(glm_b200):
    balanced = _uniform(16, 32768, 1)
    skewed = StepBatch.make([32768] * 16, 1, np.zeros(16, dtype=np.int64))
    for l in (Layout.DP, Layout.DOP):
        assert _cost(glm_b200, l, skewed).stages["attention"] == pytest.approx(
            8 * _cost(glm_b200, l, balanced).stages["attention"], rel=1e-6)
    # TP and CP do not care who owns what
    assert _cost(glm_b200, Layout.TP, skewed).seconds == pytest.approx(_cost(glm_b200, Layout.TP, balanced).seconds)


def test_dsa_caps_attention_but_not_the_indexer(glm_b200):
    a, b = _uniform(16, 100_000, 1), _uniform(16, 200_000, 1)
    ca, cb = _cost(glm_b200, Layout.DP, a), _cost(glm_b200, Layout.DP, b)
    assert ca.stages["attention"] == pytest.approx(cb.stages["attention"])
    assert cb.stages["indexer"] > 1.5 * ca.stages["indexer"]


def test_dense_attention_grows_with_context():
    dep = Deployment.build("deepseek-v3", "h200")
    a, b = _uniform(16, 16384, 1), _uniform(16, 65536, 1)
    assert _cost(dep, Layout.DP, b).stages["attention"] > 3 * _cost(dep, Layout.DP, a).stages["attention"]
    assert _cost(dep, Layout.DP, a).stages["indexer"] == 0.0


def test_cp_picks_pass_kv_for_long_prefill_and_pass_q_for_decode(glm_b200):
    assert _cost(glm_b200, Layout.CP, StepBatch.make([131072], [16384], [0])).variant == "pass-kv"
    assert _cost(glm_b200, Layout.CP, _uniform(16, 131072, 1)).variant == "pass-q"


def test_a_layout_that_cannot_hold_the_batch_costs_inf(glm_b200):
    b = _uniform(16, 200_000, 1)
    c = _cost(glm_b200, Layout.TP, b, glm_b200.pools)
    assert math.isinf(c.seconds) and not c.feasible and "does not fit" in c.reason
    times = step_times(b, glm_b200.model, glm_b200.profile, glm_b200.sizes, glm_b200.pools)
    assert set(times) == set(ALL_LAYOUTS) and math.isinf(times[Layout.TP])
    assert all(math.isfinite(times[l]) for l in (Layout.CP, Layout.DP, Layout.DOP))


def test_stage_breakdown_adds_up(glm_b200):
    c = _cost(glm_b200, Layout.DOP, _uniform(16, 8192, 512))
    assert sum(c.stages.values()) == pytest.approx(c.seconds)
    assert len(c.layer_seconds) == glm_b200.model.num_layers
    assert sum(c.layer_seconds) < c.seconds


# ---- the paper's ordering (§5.2, B=16, GLM-5 on B200) -----------------------------------------

@pytest.fixture(scope="module")
def b16_sweep(glm_b200):
    return sweep(glm_b200, 16, tuple(1024 * k for k in (1, 4, 16, 64, 128, 512)))


def test_sweep_short_inputs_tp_middle_dp(b16_sweep):
    lead = b16_sweep["leaders"]
    assert lead["1024"] == "tp" and lead["4096"] == "tp"  # paper: TP at 1K-4K
    assert lead["16384"] == "dp" and lead["65536"] == "dp"  # paper: DP-attention at 16K-64K
    for length in ("65536", "131072", "524288"):  # TP's replicated KV and indexer lose at long inputs
        tps = b16_sweep["tokens_per_s"][length]
        assert tps["tp"] < min(tps["cp"], tps["dp"], tps["dop"])


@pytest.mark.xfail(strict=True, reason="spec-calibrated model: at B=16 (T | B) DP-attention's balanced owners "
                   "match CP's position split and pay less exchange than DOP, so DP stays ahead at 128K-512K; "
                   "the paper's CP@128K / DOP@256K-512K lead is 3-11% and needs measured θ")
def test_sweep_long_inputs_follow_the_paper(b16_sweep):
    assert b16_sweep["leaders"]["131072"] == "cp" and b16_sweep["leaders"]["524288"] == "dop"


# ---- switch costs ---------------------------------------------------------------------------------

def test_switch_cost_ordering_at_256k(glm_b200):
    dep = glm_b200
    kv = BatchKV.uniform(16, 262144, 8)
    step = _uniform(16, 262144 + 1024, 1024)
    costs = {}
    for plan in all_switches(dep.sizes, kv, 8):
        dst = _cost(dep, plan.dst, step)
        costs[(plan.src, plan.dst)] = switch_cost(plan, dep.profile, dst.layer_seconds)
    assert costs[(Layout.TP, Layout.DOP)].blocking_s == 0.0
    assert costs[(Layout.DP, Layout.DOP)].blocking_s == 0.0
    # into TP does not fit at this size; among the rest DOP -> CP (weights + KV) costs most
    fitting = {k: v for k, v in costs.items() if k[1] is not Layout.TP}
    assert max(fitting, key=lambda k: fitting[k].blocking_s) == (Layout.DOP, Layout.CP)
    for k, c in costs.items():
        if c.blocking_s > 0:
            assert c.overlapped_s < 0.05 * c.blocking_s, k


def test_overlap_formula():
    assert overlapped_seconds([1.0, 1.0, 3.0], [2.0, 2.0, 2.0]) == pytest.approx(1.0 + 0 + 1.0)
    assert overlapped_seconds([], 1.0) == 0.0
    plan = SwitchPlan.build("dop", "cp", Deployment.build("glm5-nano", "cpu").sizes, BatchKV.uniform(2, 64, 2), 2)
    c = switch_cost(plan, PRESETS["cpu"], 0.0)
    assert c.overlapped_s == pytest.approx(c.blocking_s)  # nothing to hide behind


# ---- profiles -------------------------------------------------------------------------------------

def test_presets_follow_public_specs():
    b, h, h1 = PRESETS["b200"], PRESETS["h200"], PRESETS["h100"]
    assert b.world_size == h.world_size == 8
    assert b.memory_bytes > h.memory_bytes > h1.memory_bytes
    assert b.weight_read_Bps > h.weight_read_Bps > h1.weight_read_Bps
    assert h.matmul_flops == h1.matmul_flops < b.matmul_flops
    assert b.all_to_all.bandwidth_Bps == pytest.approx(2 * h.all_to_all.bandwidth_Bps)


def test_profile_yaml_round_trip(tmp_path):
    for name in ("b200", "cpu"):
        path = tmp_path / f"{name}.yaml"
        save_profile(PRESETS[name], path)
        assert load_profile(str(path)) == PRESETS[name]


def test_profile_errors_name_the_field(tmp_path):
    import yaml
    raw = PRESETS["h100"].to_dict()
    del raw["kv_read_Bps"]
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="kv_read_Bps"):
        load_profile(str(tmp_path / "a.yaml"))
    raw = PRESETS["h100"].to_dict()
    raw["all_reduce"] = {"latency_s": 1e-5}
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="all_reduce"):
        load_profile(str(tmp_path / "b.yaml"))
    raw = PRESETS["h100"].to_dict()
    raw["mem_fraction"] = 1.5
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="mem_fraction"):
        load_profile(str(tmp_path / "c.yaml"))
    with pytest.raises(ValueError, match="hardware"):
        load_profile("no-such-gpu")
    with pytest.raises(ValueError, match="world_size"):
        HardwareProfile.from_dict({**PRESETS["cpu"].to_dict(), "world_size": "two"})


def test_reference_backend_gather_threshold_matches_the_model():
    from splash_rollout.models.attention_math import SPARSE_MIN_KEYS
    from splash_rollout.scheduling.cost_model import REF_SPARSE_MIN_KEYS

    assert REF_SPARSE_MIN_KEYS == SPARSE_MIN_KEYS


def test_torch_ref_engine_prices_the_dense_rectangle_and_the_replicated_cp():
    """Below the gather threshold the reference backend scores every key (a rectangle), above it
    only the selected ones; its CP runs the replicated variant."""
    from splash_rollout.engine.rank_engine import sizes_for
    from splash_rollout.models.config import resolve_model

    cfg = resolve_model("glm5-nano")  # index_topk 64
    sizes = sizes_for(cfg, torch.float32)
    prof = load_profile("cpu").replace(engine="torch_ref", score_element_s=1e-9, kv_read_Bps=1e18)

    def att(s: int) -> float:  # scoring only: reads made free
        return step_time("dp", StepBatch.make([s], [1], [0]), cfg, prof, sizes).stages["attention"]
    assert att(200) > 3 * att(100) / 2 * 0.99  # dense: grows with the history
    assert att(1024) == pytest.approx(att(2048))  # gathered: top-k keys whatever the history
    cp = step_time("cp", StepBatch.make([512, 512], [512, 512], [0, 1]), cfg, prof, sizes)
    assert cp.variant == "replicated"
    ideal = load_profile("cpu").replace(engine="ideal")
    assert step_time("cp", StepBatch.make([512, 512], [512, 512], [0, 1]), cfg, ideal, sizes).variant in ("pass-q", "pass-kv")


def test_fit_recovers_the_constants_it_was_given():
    from splash_rollout.scheduling.profile import CollectiveCost

    """Points priced by a known θ (torch_ref engine, overheads set) are fitted back to within a few %
    from a start that has the fitted constants wrong."""
    from splash_rollout.engine.rank_engine import sizes_for
    from splash_rollout.models.config import resolve_model
    from splash_rollout.scheduling.fit import fit_profile, predict_point

    cfg = resolve_model("glm5-nano")
    sizes = sizes_for(cfg, torch.float32)
    truth = load_profile("cpu").replace(engine="torch_ref", request_layer_s=2e-4, request_step_s=3e-4,
                                        score_element_s=2e-9, expert_call_s=1e-4, step_overhead_s=5e-3)
    points = []
    for layout in ("tp", "cp", "dp", "dop"):
        for b in (1, 4, 16):
            for s in (32, 256, 1024):
                pre, dec = predict_point({"layout": layout, "batch": b, "context": s}, cfg, truth, sizes)
                points.append({"layout": layout, "batch": b, "context": s, "prefill_ms": pre, "decode_ms": dec})
    start = truth.replace(request_layer_s=1e-5, request_step_s=1e-5, score_element_s=1e-10, step_overhead_s=1e-4,
                          all_reduce=CollectiveCost(1e-5, 1e8))  # rates stay: the fit keeps them
    fitted, report = fit_profile(points, cfg, sizes, start, engine="torch_ref")
    assert report["median_abs_error"] < 0.02
    assert fitted.engine == "torch_ref"
    for p in points[::7]:
        pre, dec = predict_point(p, cfg, fitted, sizes)
        assert pre == pytest.approx(p["prefill_ms"], rel=0.1) and dec == pytest.approx(p["decode_ms"], rel=0.1)


def test_cpu_engine_prices_causal_keys_and_expanded_prefill():
    """The native backend reads only the keys a row sees (no rectangle, no gather) and runs long
    prefill chunks in expanded form: cheaper than the reference's absorbed rectangle on prefill, the
    same causal pairs as ``ideal`` on decode."""
    from splash_rollout.engine.rank_engine import sizes_for
    from splash_rollout.models.config import resolve_model
    from splash_rollout.scheduling.cost_model import expanded_is_cheaper

    cfg = resolve_model("glm5-nano")
    sizes = sizes_for(cfg, torch.float32)
    base = load_profile("cpu").replace(score_element_s=0.0, kv_read_Bps=1e18)
    ref, native, ideal = (base.replace(engine=e) for e in ("torch_ref", "cpu", "ideal"))

    def att(prof, s, q):
        return step_time("tp", StepBatch.make([s], [q], [0]), cfg, prof, sizes).stages["attention"]
    assert att(native, 40, 1) == pytest.approx(att(ideal, 40, 1))  # decode: causal pairs, absorbed
    assert att(native, 40, 1) == pytest.approx(att(ref, 40, 1))  # one row: the rectangle is the causal row
    assert att(native, 48, 8) < att(ref, 48, 8)  # a short chunk stays absorbed, but skips the masked corner
    assert att(native, 60, 60) < 0.7 * att(ideal, 60, 60)  # a whole prompt within the top-k: expanded
    assert att(native, 512, 512) == pytest.approx(att(ideal, 512, 512))  # 512 keys, 64 selected: absorbed
    assert expanded_is_cheaper(512, 512, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)
    assert not expanded_is_cheaper(512, 512, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                   cfg.v_head_dim, cfg.index_topk)
    assert not expanded_is_cheaper(1, 512, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)


def test_replicated_feed_forward_drops_dp_collectives_and_holds_every_expert():
    """Replicated MLP / MoE weights: a DP-attention rank runs the block on its own rows with no
    collective (neither the input gather nor the reduce-scatter); replicated-row layouts pay one
    all-gather of the block's output instead of the all-reduce; every rank holds the whole block."""
    from splash_rollout.engine.rank_engine import sizes_for
    from splash_rollout.layout import other_weight_bytes_per_rank
    from splash_rollout.models.config import resolve_model

    cfg = resolve_model("glm5-nano")
    sizes = sizes_for(cfg, torch.float32)
    sharded = load_profile("cpu").replace(world_size=2)
    replicated = sharded.replace(feed_forward="replicated")
    batch = StepBatch.make([160] * 64, [1] * 64, np.arange(64) % 2)
    dp_sh, dp_rep = (step_time("dp", batch, cfg, p, sizes) for p in (sharded, replicated))
    assert dp_sh.stages["mlp_comm"] > 0 and dp_sh.stages["attn_comm"] == 0  # gather + reduce-scatter: the block's
    assert dp_rep.stages["mlp_comm"] == 0 and dp_rep.stages["attn_comm"] == 0
    assert dp_rep.stages["attention"] == pytest.approx(dp_sh.stages["attention"])  # attention is untouched
    tp_sh, tp_rep = (step_time("tp", batch, cfg, p, sizes) for p in (sharded, replicated))
    assert tp_rep.stages["mlp_comm"] > 0 and tp_rep.stages["mlp_comm"] != tp_sh.stages["mlp_comm"]  # all-gather
    one_rank = other_weight_bytes_per_rank(cfg, 1, "fp32")
    assert other_weight_bytes_per_rank(cfg, 2, "fp32", "replicated") > other_weight_bytes_per_rank(cfg, 2, "fp32")
    assert other_weight_bytes_per_rank(cfg, 2, "fp32", "replicated") == one_rank  # this engine: vocab replicated
    assert other_weight_bytes_per_rank(cfg, 2, "fp32", "replicated", vocab="sharded") < one_rank  # embeddings split
    with pytest.raises(ValueError, match="feed_forward: expected one of"):
        sharded.replace(feed_forward="split")


def test_this_engines_collectives_are_priced_from_its_executors_account(monkeypatch):
    """The cost model prices what ``layout/traffic.py`` states (the account the byte-count test holds
    the executors to): one more collective in a layout's account costs exactly its time per layer."""
    from splash_rollout.engine.rank_engine import sizes_for
    from splash_rollout.layout import traffic
    from splash_rollout.models.config import resolve_model

    cfg = resolve_model("glm5-nano")
    sizes = sizes_for(cfg, torch.float32)
    profile = load_profile("cpu").replace(world_size=2)
    batch = StepBatch.make([160] * 6, [1] * 6, np.arange(6) % 2)
    before = step_time("dop", batch, cfg, profile, sizes)
    extra = traffic.all_gather("step/attn", (6, 6), 1 << 20)
    account = traffic.BY_LAYOUT[Layout.DOP]
    monkeypatch.setitem(traffic.BY_LAYOUT, Layout.DOP, lambda shape: account(shape) + [extra])
    after = step_time("dop", batch, cfg, profile, sizes)
    scale = profile.scale("comm", "dop")
    assert after.stages["attn_comm"] - before.stages["attn_comm"] == pytest.approx(
        cfg.num_layers * scale * profile.all_gather.time(extra.busiest_bytes))
