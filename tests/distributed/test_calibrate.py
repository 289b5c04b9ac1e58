"""The calibration command measures this group and writes a profile the scheduler loads."""
import json

import pytest

from splash_rollout.calibrate.__main__ import QUICK_CONTEXTS, main
from splash_rollout.layout.layouts import ALL_LAYOUTS
from splash_rollout.scheduling.profile import load_profile


@pytest.mark.slow
def test_calibrate_quick_measures_the_group_and_the_engine_grid_and_fits_them(tmp_path, capsys):
    """``--quick``: microbenchmarks, the small engine grid on every layout, the fit, a profile the
    scheduler loads (one run: the microbenchmarks are the fit's starting point); bad input refused."""
    assert main(["--world-size", "0"]) == 2 and "--world-size" in capsys.readouterr().err
    out, points = tmp_path / "p.yaml", tmp_path / "points.json"
    # the quick grid without its largest batch (the run's longest third): 16 points still fit
    assert main(["--world-size", "2", "--quick", "--batches", "1,4", "--out", str(out), "--points-json", str(points)]) == 0
    profile = load_profile(str(out))
    assert profile.world_size == 2 and profile.engine == "cpu" and profile.request_step_s > 0
    assert profile.matmul_flops > 1e8 and profile.weight_read_Bps > 1e8
    report = json.loads(points.read_text())
    micro = report["microbenchmarks"]  # what the group measured before the fit moved anything
    for name in ("all_gather", "all_to_all", "all_reduce"):
        assert micro[name]["latency_s"] > 0 and micro[name]["bandwidth_Bps"] > 0
    grid = {(p["layout"], p["batch"], p["context"]) for p in report["points"]}
    assert grid == {(layout.value, b, s) for layout in ALL_LAYOUTS for b in (1, 4) for s in QUICK_CONTEXTS}
    assert 0 <= report["fit"]["median_abs_error"] < 1.0
