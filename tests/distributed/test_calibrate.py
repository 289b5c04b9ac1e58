"""The calibration command measures this group and writes a profile the scheduler loads."""
from splash_rollout.calibrate.__main__ import main
from splash_rollout.scheduling.profile import load_profile


def test_calibrate_writes_a_loadable_profile(tmp_path, capsys):
    out = tmp_path / "profile.yaml"
    assert main(["--world-size", "2", "--out", str(out), "--no-engine-fit"]) == 0
    profile = load_profile(str(out))
    assert profile.world_size == 2 and profile.matmul_flops > 1e8 and profile.weight_read_Bps > 1e8
    for cost in (profile.all_gather, profile.all_to_all, profile.all_reduce):
        assert cost.latency_s > 0 and cost.bandwidth_Bps > 0
    assert main(["--world-size", "0"]) == 2 and "--world-size" in capsys.readouterr().err
