"""The terms the published sweeps need, the disaggregated serving model, and the fit (pure, CPU)."""
import json
from dataclasses import replace

import numpy as np
import yaml
import pytest

from splash_rollout.layout import GiB, Layout
from splash_rollout.scheduling import CollectiveCost, Deployment, StepBatch, load_profile, step_time
from splash_rollout.scheduling.numeric_fit import levenberg_marquardt, nnls, nnls_hinge
from splash_rollout.scheduling.deployment import kv_senders
from splash_rollout.scheduling.platforms import load_serving, save_serving, spec_serving
from splash_rollout.sim import paper


@pytest.fixture(scope="module")
def b200():
    return paper.base_serving("b200")


def _cost(dep, layout, batch, profile=None):
    return step_time(layout, batch, dep.model, profile or dep.profile, dep.sizes)


def test_pools_reproduce_table_3_on_b200(b200):
    table = paper.paper_data()["pools"]["B200"]
    for l, fp in b200.prefill.footprints.items():
        gib, _, distinct = table[l.value]
        assert fp.distinct_tokens == distinct
        assert fp.pool_bytes_per_rank / GiB == pytest.approx(gib, abs=0.01)


def test_per_layout_fixed_costs_are_charged_where_they_belong():
    dep = Deployment.build("glm-5", "b200")
    prof = dep.profile.replace(layout_step_s={"dp": 0.1}, layout_request_s={"dp": 0.5}, layout_token_s={"dp": 1e-6})
    b = StepBatch.make([4096, 4096, 10], [4096, 4096, 1], [0, 1, 2], prefill_done=2)
    for l in (Layout.DP, Layout.TP):
        extra = _cost(dep, l, b, prof).stages["overhead"] - _cost(dep, l, b).stages["overhead"]
        # 0.1 per step + 2 finished prefills x 0.5 + 8192 prefill rows (the decode row is not one) x 1 us
        assert extra == pytest.approx(0.1 + 1.0 + 8192e-6 if l is Layout.DP else 0.0, abs=1e-12)
    with pytest.raises(ValueError, match="prefill_done"):
        StepBatch.make([8], [8], [0], prefill_done=2)


def test_stage_scale_for_one_layout_overrides_the_shared_one():
    dep = Deployment.build("glm-5", "b200")
    prof = dep.profile.replace(stage_scale={"attention": 3.0, "attention/dp": 2.0})
    b = StepBatch.make([65536] * 8, 1, np.arange(8))
    for l, k in ((Layout.DP, 2.0), (Layout.CP, 3.0)):
        base, scaled = _cost(dep, l, b).stages, _cost(dep, l, b, prof).stages
        assert scaled["attention"] == pytest.approx(k * base["attention"])
        assert scaled["indexer"] == pytest.approx(k * base["indexer"])
        assert scaled["mlp"] == pytest.approx(base["mlp"])
    with pytest.raises(ValueError, match="stage_scale"):
        dep.profile.replace(stage_scale={"attention/xx": 1.0})


def test_dop_runs_the_input_projections_on_the_owner_rows_only():
    dep = Deployment.build("glm-5", "b200")
    b = StepBatch.make([16384] * 8, [16384] * 8, np.arange(8))  # compute-bound prefill, one request per owner
    tp, dp, dop = (_cost(dep, l, b).stages["attn_in"] for l in (Layout.TP, Layout.DP, Layout.DOP))
    assert dop == pytest.approx(dp) and dop == pytest.approx(tp / 8)


def test_dop_collectives_by_hand():
    """Latency 0, 1 B/s: the attention collectives' seconds are the busiest rank's bytes per layer."""
    dep = Deployment.build("glm-5", "b200")
    one = CollectiveCost(0.0, 1.0)
    prof = dep.profile.replace(all_gather=one, all_to_all=one, all_reduce=one)
    t, n, hd, h = 8, 8, 6144, 64  # one decode row per owner
    b = StepBatch.make([1000] * 8, 1, np.arange(8))
    per_layer = _cost(dep, Layout.DOP, b, prof).stages["attn_comm"] / 78
    q_latent = 7 * 2048 * 2  # the other owners' q latent rows
    a2a = lambda width: max(7 * (h / t) * width * 2, 1 * h * 7 / 8 * width * 2)  # sent vs received
    reduce_scatter = n * hd * 2 * 7 / 8
    gather_back = 7 * hd * 2
    assert per_layer == pytest.approx(q_latent + a2a(576) + a2a(512) + reduce_scatter + gather_back)


def test_chunked_prefill_step_counts():
    dep = paper._unit(paper.base_serving("b200").prefill)
    # TP: 16,384 rows per step over the group; DP-attention / DOP: 2,048 per owner
    assert paper.prefill_features(dep, Layout.TP, 65536, 4)[1] == 16
    assert paper.prefill_features(dep, Layout.DP, 65536, 4)[1] == 32  # 4 owners busy, 32 chunks each
    assert paper.prefill_features(dep, Layout.DOP, 65536, 12)[1] == 64  # 4 owners hold 2 requests
    assert paper.prefill_features(dep, Layout.DP, 1024, 16)[1] == 1  # two 1K prompts per owner per step
    assert paper.prefill_features(dep, Layout.CP, 1024, 32)[1] == 2


def test_prediction_is_the_sum_of_priced_steps(b200):
    """With constants set by hand the batch time is: every prefill step priced by step_time with the
    profile (a per-request constant included, which a profile may carry), plus decode x scale, the
    last prompt's transfer, the layout's batch constant."""
    cols = paper.columns((*paper.PER_LAYOUT_DEFAULT, "requests"), paper.BASE)
    coef = {c: 0.0 for c in cols}
    coef.update({c: 1.3 for c in cols if c.split("/")[0] in ("compute", "attention", "comm")})
    coef.update({"overhead": 1.0, "steps/tp": 0.01, "requests/tp": 0.2, "tokens/tp": 1e-6, "decode": 2.0,
                 "transfer_bytes": 1e-10, "batch/tp": 3.0, "batch/cp": 5.0})
    s = paper.with_coefficients(b200, cols, [coef[c] for c in cols])
    assert s.batch_overhead_s == {"tp": 3.0, "cp": 5.0, "dp": 0.0, "dop": 0.0}
    pt = paper.Point("x", 65536, 2, {l: 1.0 for l in paper.LAYOUT_NAMES})
    got = pt.tokens / (paper.predict(s, [pt])[0, 0] * 1e3)
    dep = s.prefill
    steps = 0.0
    for i in range(2):  # TP: requests one after the other, 4 chunks each
        for j in range(4):
            b = StepBatch.make([(j + 1) * 16384], [16384], [0], sampling_rows=1 if j == 3 else 0,
                               prefill_done=1 if j == 3 else 0)
            steps += _cost(dep, Layout.TP, b).seconds
    dec = paper.decode_seconds(paper.base_serving("b200").decode, 65536, 2)
    want = steps + 2.0 * dec + 65536 * dep.sizes.kv_bytes_per_token_total * 1e-10 + 3.0
    assert got == pytest.approx(want, rel=1e-9)


def _batch_seconds(serving, pt):
    """[4] predicted T_batch per layout (s)."""
    return pt.tokens / (paper.predict(serving, [pt])[0] * 1e3)


def test_a_layout_batch_constant_shifts_only_that_layouts_batch_time(b200):
    pt = paper.Point("x", 4096, 16, {l: 1.0 for l in paper.LAYOUT_NAMES})
    before = _batch_seconds(b200, pt)
    shifted = replace(b200, batch_overhead_s={"tp": 0.0, "cp": 7.0, "dp": 0.5, "dop": 12.25})
    np.testing.assert_allclose(_batch_seconds(shifted, pt) - before, [0.0, 7.0, 0.5, 12.25], rtol=0, atol=1e-9)
    one = replace(b200, batch_overhead_s=2.0)  # one number: every layout
    assert one.batch_overhead_s == {l: 2.0 for l in paper.LAYOUT_NAMES}
    np.testing.assert_allclose(_batch_seconds(one, pt) - before, [2.0] * 4, rtol=0, atol=1e-9)
    assert replace(b200, batch_overhead_s={"dp": 1.0}).batch_seconds(Layout.TP) == 0.0
    for bad, match in (({"xx": 1.0}, "unknown layout"), ({"tp": -1.0}, "non-negative"), ("3", "number or a mapping")):
        with pytest.raises(ValueError, match=match):
            replace(b200, batch_overhead_s=bad)


def test_cp_sends_the_last_prompt_from_all_its_ranks(b200):
    """The last prompt's KV transfer: a CP prompt leaves the 8 ranks that hold its slices at once;
    TP, DP-attention and DOP send it from one rank. Halving the rate adds exactly bytes / rate /
    senders to each layout's batch time."""
    pt = paper.Point("x", 131072, 4, {l: 1.0 for l in paper.LAYOUT_NAMES})
    kv = 131072 * b200.prefill.sizes.kv_bytes_per_token_total
    feats = paper.feature_table(b200, [pt])[0, :, paper.BASE.index("transfer_bytes")]
    np.testing.assert_allclose(feats, [kv, kv / 8, kv, kv], rtol=1e-12)
    assert kv_senders(Layout.CP, 8) == 8 and kv_senders(Layout.DOP, 8) == 1
    rate = b200.kv_transfer_Bps
    slower = replace(b200, kv_transfer_Bps=rate / 2)
    np.testing.assert_allclose(_batch_seconds(slower, pt) - _batch_seconds(b200, pt),
                               [kv / rate, kv / rate / 8, kv / rate, kv / rate], rtol=1e-9)


def test_fit_recovers_constants_it_was_given(b200):
    pts = paper.points("b200", ["B16_in", "64K_bs"])
    table = paper.feature_table(b200, pts)
    cols = paper.columns(paper.PER_LAYOUT_DEFAULT)
    assert not any(c.startswith("requests") for c in cols)  # the default fit has no per-request constants
    rng = np.random.default_rng(1)
    truth = {c: 0.0 for c in cols}
    truth.update({c: float(rng.uniform(0.5, 2.0)) for c in cols if c.split("/")[0] in ("compute", "attention", "comm")})
    truth.update({"overhead": 1.0, "steps/dp": 0.05, "tokens/cp": 2e-6, "decode": 1.5, "transfer_bytes": 1e-9,
                  "batch/tp": 2.0, "batch/cp": 9.0, "batch/dop": 4.0})
    secs = paper.design(table, cols) @ np.array([truth[c] for c in cols])
    synthetic = [paper.Point(p.sweep, p.input_tokens, p.batch,
                             {l: p.tokens / secs[i, k] / 1e3 for k, l in enumerate(paper.LAYOUT_NAMES)})
                 for i, p in enumerate(pts)]
    fitted, info = paper.fit(b200, synthetic, table, prior_weight=0.0)
    assert info["max_abs_error"] < 1e-6
    for l, want in (("tp", 2.0), ("cp", 9.0), ("dp", 0.0), ("dop", 4.0)):
        assert fitted.batch_seconds(l) == pytest.approx(want, abs=1e-6)
    assert fitted.prefill.profile.layout_request_s == {}
    got = paper.predict(fitted, synthetic, table)
    want = np.array([[p.measured[l] for l in paper.LAYOUT_NAMES] for p in synthetic])
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_nnls_meets_the_optimality_conditions():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((40, 6)), rng.standard_normal(40)
    x = nnls(a, b)
    grad = a.T @ (a @ x - b)
    assert (x >= 0).all()
    np.testing.assert_allclose(grad[x > 0], 0.0, atol=1e-9)
    assert (grad[x == 0] >= -1e-9).all()


def test_nnls_hinge_meets_the_optimality_conditions():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((30, 5)), rng.standard_normal(30)
    g, c = rng.standard_normal((12, 5)), rng.standard_normal(12) * 0.1
    x, rounds = nnls_hinge(a, b, g, c)
    hinge = np.maximum(g @ x - c, 0.0)
    assert rounds >= 1 and hinge.any()  # some ordering rows bind: the case is not plain NNLS
    grad = a.T @ (a @ x - b) + g.T @ hinge
    assert (x >= 0).all()
    np.testing.assert_allclose(grad[x > 0], 0.0, atol=1e-9)
    assert (grad[x == 0] >= -1e-9).all()
    # rows that never bind leave the NNLS answer alone
    far, _ = nnls_hinge(a, b, g, np.full(12, 1e6))
    np.testing.assert_allclose(far, nnls(a, b), atol=1e-12)


def test_ordering_term_by_hand():
    """One point, two layouts measured at 1.0 s and 1.1 s, one constant u that prices them 1.2 u and
    u: every u > 0 puts the slower layout ahead, by 0.2 u relative to the leader's 1.0 s. Least
    squares: u (1.44 + 1/1.21) = 1.2 + 1/1.1; the ordering term adds w 0.04 u to the left."""
    d = np.array([[[1.2], [1.0]]])
    measured = np.array([[1.0, 1.1]])
    lhs, rhs = 1.44 + 1 / 1.21, 1.2 + 1 / 1.1
    for w in (0.0, 1.0, 25.0):
        coef, rounds = paper.solve_constants(d, ["u"], measured, {}, prior_weight=0.0, rank_weight=w)
        assert coef[0] == pytest.approx(rhs / (lhs + 0.04 * w), rel=1e-9)
        assert (rounds == 0) == (w == 0)


def test_ordering_term_is_silent_once_the_leader_is_ahead(b200):
    # synthetic points from known constants: predicted and measured leaders agree, so the fit with the
    # ordering term is the least-squares fit
    pts = paper.points("b200", ["B32_in"])
    table = paper.feature_table(b200, pts)
    plain, _ = paper.fit(b200, pts, table, rank_weight=0.0)
    synthetic = [paper.Point(p.sweep, p.input_tokens, p.batch, {l: float(v) for l, v in zip(paper.LAYOUT_NAMES, row)})
                 for p, row in zip(pts, paper.predict(plain, pts, table))]
    a, ia = paper.fit(b200, synthetic, table, prior_weight=0.0, rank_weight=0.0)
    b, ib = paper.fit(b200, synthetic, table, prior_weight=0.0, rank_weight=1.0)
    assert ia["train_leaders_missed"] == ib["train_leaders_missed"] == 0
    np.testing.assert_allclose(paper.predict(a, pts, table), paper.predict(b, pts, table), rtol=1e-9)


def test_levenberg_marquardt_solves_rosenbrock_within_bounds():
    f = lambda x: np.array([x[0] - 1.0, 10.0 * (x[1] - x[0] ** 2)])
    x, r, _ = levenberg_marquardt(f, np.array([-1.2, 1.0]), np.array([-5.0, -5.0]), np.array([5.0, 5.0]))
    np.testing.assert_allclose(x, [1.0, 1.0], atol=1e-6)
    x, _, _ = levenberg_marquardt(f, np.array([0.0, 0.0]), np.array([-5.0, -5.0]), np.array([0.5, 5.0]))
    assert x[0] == pytest.approx(0.5, abs=1e-6)


def test_serving_yaml_round_trip(tmp_path, b200):
    s = replace(b200, batch_overhead_s={"tp": 1.5, "cp": 2.5, "dp": 3.5, "dop": 4.5})
    save_serving(s, tmp_path / "s.yaml")
    assert yaml.safe_load((tmp_path / "s.yaml").read_text())["batch_overhead_s"] == s.batch_overhead_s
    back = load_serving(tmp_path / "s.yaml")
    assert back.prefill.profile == b200.prefill.profile and back.prefill.pools == b200.prefill.pools
    assert back.decode.world_size == 16 and back.kv_transfer_Bps == b200.kv_transfer_Bps
    assert back.batch_overhead_s == s.batch_overhead_s
    with pytest.raises(ValueError, match="platform or file"):
        load_serving(tmp_path / "missing.yaml")
    assert load_profile("b200-paper").world_size == 8


def test_a_serving_yaml_with_one_batch_constant_still_loads(tmp_path, b200):
    """YAMLs written before the batch constant was per layout hold one number: every layout pays it."""
    save_serving(b200, tmp_path / "s.yaml")
    raw = yaml.safe_load((tmp_path / "s.yaml").read_text())
    raw["batch_overhead_s"] = 14.0
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(raw))
    old = load_serving(tmp_path / "old.yaml")
    assert old.batch_overhead_s == {"tp": 14.0, "cp": 14.0, "dp": 14.0, "dop": 14.0}
    del raw["batch_overhead_s"]
    (tmp_path / "none.yaml").write_text(yaml.safe_dump(raw))
    assert load_serving(tmp_path / "none.yaml").batch_seconds("dop") == 0.0
    for bad, match in (("[1, 2]", "batch_overhead_s"), ("{tp: -1}", "non-negative"), ("{gpu: 1}", "unknown layout")):
        (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**raw, "batch_overhead_s": yaml.safe_load(bad)}))
        with pytest.raises(ValueError, match=match):
            load_serving(tmp_path / "bad.yaml")


def test_cli_fit_and_paper(tmp_path, capsys):
    from splash_rollout.sim.__main__ import main

    out, js = tmp_path / "h.yaml", tmp_path / "p.json"
    assert main(["fit", "--platform", "h200", "--train", "B16_in", "--out", str(out)]) == 0
    assert main(["paper", "--platform", "h200", "--profile", str(out), "--eval", "B32_in", "--json", str(js)]) == 0
    res = json.loads(js.read_text())
    p = res["points"][0]
    assert set(p) >= {"sweep", "input_tokens", "B", "predicted", "chosen", "regret"}
    assert set(p["predicted"]) == {"tp", "cp", "dp", "dop"} and p["chosen"] in p["predicted"]
    assert 0.0 <= p["regret"] < 1.0 and len(res["points"]) == 7
    assert main(["fit", "--platform", "h200", "--train", "B99", "--out", str(out)]) == 2
    assert "--train" in capsys.readouterr().err
    assert main(["fit", "--platform", "h200", "--train", "B16_in", "--out", str(out), "--rank-weight", "-1"]) == 2
    assert "--rank-weight" in capsys.readouterr().err
    assert main(["paper", "--platform", "tpu"]) == 2
    assert "--platform" in capsys.readouterr().err


def test_named_workloads_and_drain_ratios():
    from splash_rollout.sim.runs import WORKLOADS, drain, named_workload

    paper_work = named_workload("paper")
    assert paper_work.size == 2048 + 8 and (paper_work.prompt[-8:] >= 256 * 1024).all()
    assert (paper_work.prompt[:2048] <= 4096).all() and (paper_work.output <= paper_work.max_new).all()
    for name in WORKLOADS:
        assert named_workload(name).size > 0
    with pytest.raises(ValueError, match="--workload"):
        named_workload("nope")
    r = drain(Deployment.build("glm-5", "b200-paper"), named_workload("tail-only"))
    tps = r["tokens_per_s"]
    assert r["ratio_adaptive_vs_dp"] == pytest.approx(tps["adaptive"] / tps["dp"])
    assert r["switch_path"].split()[0] == r["timeline"][0]["layout"]
    assert r["switch_path"].count("->") == len(r["switches"])
