"""Online correction of θ: hand-computed fits, the prior with few steps, convergence, transfer to
layouts not yet run, and the policy pricing with the corrected θ."""
import math

import numpy as np
import pytest

from splash_rollout.layout import Layout
from splash_rollout.scheduling import LayoutPolicy, StepBatch
from splash_rollout.scheduling.online import (GROUPS, CorrectionConfig, StepTimeCorrection, stage_groups,
                                              step_shape)
from tests.pinned_profile import PINNED_PROFILE

AUTO_ON_TWO = dict(model="glm5-nano", world_size=2, layout="auto", profile=PINNED_PROFILE)

COMPUTE = np.array([1.0, 0.0, 0.0, 0.0])  # θ: one second of compute, nothing else


def test_hand_computed_four_levels():
    """8 steps θ prices at 1 s of compute that take 2 s, every prior worth 8 steps:
    f_compute = (8·½ + 8) / (8·¼ + 8) = 1.2; r = log(2 / 1.2); g = 8r / 16 = r/2;
    a = 8(r - g) / 16 = r/4; b = 8(r - g - a) / 16 = r/8."""
    c = StepTimeCorrection(CorrectionConfig(prior_steps=8, global_prior_steps=8, layout_prior_steps=8,
                                            shape_prior_steps=8, layout_spread=0.2))
    for _ in range(8):
        c.observe("dp", "decode/b4", COMPUTE, 2.0)
    f = c.factors()
    assert f.stage == pytest.approx([1.2, 1.0, 1.0, 1.0])
    r = math.log(2.0 / 1.2)
    assert f.global_log == pytest.approx(r / 2) and f.layout_log["dp"] == pytest.approx(r / 4)
    assert f.shape_log[("dp", "decode/b4")] == pytest.approx(r / 8)
    assert f.seconds("dp", "decode/b4", COMPUTE) == pytest.approx(1.2 * math.exp(7 * r / 8))
    assert f.seconds("dp", "prefill/b4", COMPUTE) == pytest.approx(1.2 * math.exp(3 * r / 4))  # no shape level
    assert f.seconds("tp", "decode/b4", COMPUTE) == pytest.approx(1.2 * math.exp(r / 2))  # not run: shared levels
    # doubt: prior spread 0.2; each step's residual about the fit is r - g - a - b = r/8, so
    # σ² = (8 (r/8)² + 8 · 0.2²) / 16 and dp's 8 steps leave 1 / sqrt(1/0.2² + 8/σ²)
    noise2 = (8 * (r / 8) ** 2 + 8 * 0.04) / 16
    assert f.uncertainty("tp") == pytest.approx(0.2)
    assert f.uncertainty("dp") == pytest.approx(1 / math.sqrt(25 + 8 / noise2))
    d = f.to_dict()
    assert d["stage"]["compute"] == 1.2 and d["observations"] == {"dp": 8}


def test_no_observations_is_theta():
    f = StepTimeCorrection().factors()
    assert f.seconds("tp", "decode/b1", np.array([0.1, 0.2, 0.3, 0.4])) == pytest.approx(1.0)


def test_the_prior_dominates_a_few_steps():
    """Steps 3x slower than θ: one moves the prediction less than a third of the way in log space
    (about 1/9 at each of the global, layout and shape levels, each shrunk by 8 pseudo-steps), two
    less than 60 %; each pulls it further."""
    x = np.array([0.5, 0.1, 0.3, 0.1])
    c, seen = StepTimeCorrection(), []
    for _ in range(3):
        c.observe("cp", "decode/b8", x, 3.0)
        seen.append(math.log(c.factors().seconds("cp", "decode/b8", x)) / math.log(3.0))
    assert 0 < seen[0] < 1 / 3 and seen[0] < seen[1] < 0.6 and seen[1] < seen[2] < 1, seen


def _synthetic(rng, n, truth_stage, truth_layout, layouts, noise=0.03):
    """n steps per layout with θ's group seconds varying like a drain (compute with the batch,
    collectives mostly latency, a fixed overhead); measured = truth · (1 ± noise)."""
    obs = []
    for l in layouts:
        for _ in range(n):
            b = int(rng.integers(1, 200))
            x = np.array([2e-4 * b, 5e-5 * b, 8e-3 + 1e-5 * b, 3e-3])
            shape = step_shape(b, int(rng.random() < 0.1))
            y = float(x @ truth_stage) * truth_layout.get(l, 1.0) * (1 + noise * rng.standard_normal())
            obs.append((l, shape, x, y))
    rng.shuffle(obs)
    return obs


def test_converges_to_the_true_factors_and_transfers_them_to_unrun_layouts():
    """θ's compute is 2x too fast and its collectives 4x too slow (truth: compute x2, comm x0.25),
    and TP's kernels are another 1.3x slower. After a drain mostly in DP with a stretch in TP the
    corrected predictions are within 5 % of the truth for both, and CP -- never run -- gets the
    shared stage factors: within 10 % of its truth, where θ was off by far more."""
    rng = np.random.default_rng(0)
    truth = np.array([2.0, 1.0, 0.25, 1.0])
    c = StepTimeCorrection()
    steps = _synthetic(rng, 600, truth, {"tp": 1.3}, ["dp"]) + _synthetic(rng, 100, truth, {"tp": 1.3}, ["tp"])
    for l, shape, x, y in steps:
        c.observe(l, shape, x, y)
    f = c.factors()
    for b in (1, 16, 150):
        x = np.array([2e-4 * b, 5e-5 * b, 8e-3 + 1e-5 * b, 3e-3])
        for l, extra in (("dp", 1.0), ("tp", 1.3), ("cp", 1.0)):
            want = float(x @ truth) * extra
            got = f.seconds(l, step_shape(b, 0), x)
            assert got == pytest.approx(want, rel=0.05 if l != "cp" else 0.10), (l, b, got, want)
        assert abs(float(x.sum()) / float(x @ truth) - 1) > 0.2  # θ alone was far off


def test_a_uniformly_wrong_preset_moves_every_layout_alike():
    """Every step takes 2x θ, and only DP has run: TP (not run) is corrected by nearly the same factor
    (the shared ridge leaves the groups steps barely exercise near 1), so the ratio θ gave between
    them is kept within 10 % -- a per-layout factor alone would make DP look 2x slower than TP."""
    rng = np.random.default_rng(1)
    c = StepTimeCorrection()
    for l, shape, x, y in _synthetic(rng, 200, np.full(4, 2.0), {}, ["dp"], noise=0.0):
        c.observe(l, shape, x, y)
    f = c.factors()
    x = np.array([2e-4 * 64, 5e-5 * 64, 8e-3, 3e-3])
    dp, tp = f.seconds("dp", step_shape(64, 0), x), f.seconds("tp", step_shape(64, 0), x)
    assert tp == pytest.approx(2.0 * x.sum(), rel=0.1) and tp / dp == pytest.approx(1.0, rel=0.1)


def test_the_window_forgets_old_steps():
    c = StepTimeCorrection(CorrectionConfig(window_steps=4))
    for y in (10.0,) * 20 + (1.0,) * 4:
        c.observe("dp", "decode/b1", COMPUTE, y)
    assert c.num_observations == 4 and c.factors().seconds("dp", "decode/b1", COMPUTE) == pytest.approx(1.0)


def test_stage_groups_and_shapes():
    stages = {"attn_in": 1.0, "attn_proj": 2.0, "mlp": 3.0, "lm_head": 4.0, "attention": 5.0, "indexer": 6.0,
              "attn_comm": 7.0, "mlp_comm": 8.0, "overhead": 9.0}
    assert list(stage_groups(stages)) == [10.0, 11.0, 15.0, 9.0] and len(GROUPS) == 4
    assert step_shape(1, 0) == "decode/b1" and step_shape(63, 0) == "decode/b32" and step_shape(64, 5) == "prefill/b64"
    assert step_shape(0, 0) == "decode/b1"


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="prior_steps"):
        CorrectionConfig(prior_steps=0)
    with pytest.raises(ValueError, match="window_steps"):
        CorrectionConfig(window_steps=0)
    with pytest.raises(ValueError, match="max_factor"):
        CorrectionConfig(max_factor=1.0)
    with pytest.raises(ValueError, match="groups"):
        StepTimeCorrection().observe("dp", "decode/b1", [1.0, 2.0], 1.0)
    c = StepTimeCorrection()
    c.observe("dp", "decode/b1", COMPUTE, 0.0)  # no time: nothing learned
    assert c.num_observations == 0


def test_the_policy_prices_with_the_corrected_theta():
    """Steps in DP measured at 3x θ: the policy's DP price follows them, the decision shows θ's own
    prices beside the corrected ones, and the corrected θ itself."""
    import torch

    from splash_rollout.models.config import resolve_model
    from splash_rollout.rollout.config import EngineConfig
    from splash_rollout.rollout.build import make_policy

    pol = make_policy(EngineConfig(**AUTO_ON_TWO), resolve_model("glm5-nano"), 2,
                      2**28, torch.float32)
    assert isinstance(pol, LayoutPolicy) and pol.correction is not None
    batch = StepBatch.make([100] * 8, 1, np.arange(8) % 2)
    prior = pol.decide(Layout.DP, batch, np.full(8, 50), 100)
    assert prior.prior_step_costs == prior.step_costs  # nothing observed: θ's prices
    for _ in range(200):
        pol.observe_step(Layout.DP, batch, 3.0 * prior.step_costs["dp"])
    d = pol.decide(Layout.DP, batch, np.full(8, 50), 100).to_dict()
    assert d["step_costs"]["dp"] == pytest.approx(3.0 * d["prior_step_costs"]["dp"], rel=0.05)
    assert d["correction"]["observations"] == {"dp": 64} and "dp" in d["correction"]["layout"]  # one cell's window
    off = make_policy(EngineConfig(**AUTO_ON_TWO, online_correction=False),
                      resolve_model("glm5-nano"), 2, 2**28, torch.float32)
    assert off.correction is None and off.decide(Layout.DP, batch, np.full(8, 50), 100).to_dict()["correction"] == {}


def test_steps_of_one_signature_share_thetas_price():
    """The driver feeds every step; θ prices a run of same-shaped steps once per REPRICE_STEPS."""
    import torch

    from splash_rollout.models.config import resolve_model
    from splash_rollout.rollout.config import EngineConfig
    from splash_rollout.rollout.build import make_policy
    from splash_rollout.scheduling.pricing import REPRICE_STEPS

    pol = make_policy(EngineConfig(**AUTO_ON_TWO), resolve_model("glm5-nano"), 2,
                      2**28, torch.float32)
    built = []

    def batch():
        built.append(1)
        return StepBatch.make([100] * 4, 1, np.arange(4) % 2)

    for _ in range(2 * REPRICE_STEPS + 1):
        pol.observe_step(Layout.DP, batch, 0.05, signature=(4, 4, 0))
    pol.observe_step(Layout.DP, batch, 0.05, signature=(3, 3, 0))  # another shape: priced at once
    assert len(built) == 4 and pol.correction.num_observations == 2 * REPRICE_STEPS + 2


def test_a_layout_never_run_is_explored_not_ruled_out_by_its_doubt():
    """In TP, one decode request: θ says DP-attention is 11 % faster. Without doubt the policy moves;
    with TP observed at θ's price and DP never run (doubt 0.2 ≈ 22 %), exploring off, it stays and
    says why. Exploring on, it tries DP (rule explore); once DP's measured steps show it 30 % slower
    than θ said, it is no longer tried."""
    import dataclasses

    import torch

    from splash_rollout.models.config import resolve_model
    from splash_rollout.rollout.config import EngineConfig
    from splash_rollout.rollout.build import make_policy
    from splash_rollout.scheduling.policy import DecisionRule

    def policy(spread, explore=8):
        base = make_policy(EngineConfig(**AUTO_ON_TWO), resolve_model("glm5-nano"), 2,
                           2**28, torch.float32)
        config = dataclasses.replace(base.config, explore_observations=explore)
        return LayoutPolicy(base.dep, config, StepTimeCorrection(CorrectionConfig(layout_spread=spread)))

    batch = StepBatch.make([400], 1, [0])
    trusting, doubting, exploring = policy(0.0), policy(0.2, explore=0), policy(0.2)
    for pol in (trusting, doubting, exploring):
        tp_s = pol.decide(Layout.TP, batch, [100], 100).prior_step_costs["tp"]
        for _ in range(64):
            pol.observe_step(Layout.TP, batch, tp_s)
    assert trusting.decide(Layout.TP, batch, [100], 100).chosen is Layout.DP
    d = doubting.decide(Layout.TP, batch, [100], 100)
    assert d.chosen is Layout.TP and not d.switch and "doubt" in d.reason, d.reason
    d = exploring.decide(Layout.TP, batch, [100], 4, measured_steps=0)  # inside an unmeasured dwell: never
    assert d.chosen is Layout.TP and d.rule is not DecisionRule.EXPLORE, d.reason
    d = exploring.decide(Layout.TP, batch, [100], 4, measured_steps=3)  # a measured one: at the dwell's factor
    assert d.rule is not DecisionRule.EXPLORE or "10 x switch" in d.reason, d.reason
    d = exploring.decide(Layout.TP, batch, [100], 100)
    assert d.chosen is Layout.DP and d.switch and d.rule is DecisionRule.EXPLORE and "0 of 8" in d.reason, d.reason
    dp_s = d.prior_step_costs["dp"]
    for _ in range(8):
        exploring.observe_step(Layout.DP, batch, 1.3 * dp_s)
    d = exploring.decide(Layout.TP, batch, [100], 100)
    assert d.chosen is Layout.TP and d.rule is not DecisionRule.EXPLORE, d.reason


def test_a_measured_stay_ends_its_dwell_for_a_switch_that_pays_many_times_over():
    """θ's fastest layout X entered 4 steps ago (dwell 16), its 3 measured steps at 3x θ's price
    beside a runner-up Y measured at θ's price: Y's saving over the horizon is far above 10x the
    round-trip switch, so the dwell ends. Two measured steps, no correction, or a factor no saving
    reaches keep the dwell."""
    import dataclasses

    import torch

    from splash_rollout.models.config import resolve_model
    from splash_rollout.rollout.config import EngineConfig
    from splash_rollout.rollout.build import make_policy

    def policy(correction=True):
        return make_policy(EngineConfig(**AUTO_ON_TWO, online_correction=correction),
                           resolve_model("glm5-nano"), 2, 2**28, torch.float32)

    batch, left = StepBatch.make([300] * 8, 1, np.arange(8) % 2), np.full(8, 200)
    theta = policy(False).decide(Layout.DP, batch, left, 100).step_costs
    fast, runner_up, *_ = sorted(theta, key=theta.get)
    X, Y = Layout(fast), Layout(runner_up)
    pol = policy()
    for _ in range(16):
        pol.observe_step(Y, batch, theta[runner_up])
    for _ in range(3):
        pol.observe_step(X, batch, 3.0 * theta[fast])
    d = pol.decide(X, batch, left, 4, measured_steps=3)
    assert d.switch and d.chosen is Y, d.reason
    assert d.reason.startswith("dwell 4/16 steps, 3 measured: a switch must pay 10x its cost"), d.reason
    held = pol.decide(X, batch, left, 4, measured_steps=2)
    assert not held.switch and held.reason == "dwell 4/16 steps", held.reason
    strict = LayoutPolicy(pol.dep, dataclasses.replace(pol.config, dwell_break_factor=1e12), pol.correction)
    d = strict.decide(X, batch, left, 4, measured_steps=3)
    assert not d.switch and d.chosen is X and "<= 1e+12 x (switch" in d.reason, d.reason
    # without a correction nothing is measured: in Y, θ's faster X waits for the dwell
    assert theta[fast] < 0.95 * theta[runner_up]
    off = policy(False).decide(Y, batch, left, 4, measured_steps=3)
    assert off.chosen is Y and not off.switch and off.reason == "dwell 4/16 steps", off.reason
