"""What a 2-rank engine's ranks and its driver hold of a checkpoint, measured (benchmarks/sharded_load.py
at a small size): two checkpoints that differ by D bytes of routed experts; each rank's peak anonymous
memory and resident set grow by at most 0.65 D between them (it holds half the experts), the
driver's by at most 0.1 D, a one-rank engine's by at most 1.2x its weights, and after a switch to
DP-attention and back every rank's weight bytes are what the footprint model says."""
import pytest

from benchmarks.sharded_load import measure


@pytest.mark.slow
def test_ranks_hold_their_share_of_the_checkpoint_and_the_driver_none(tmp_path):
    result = measure(str(tmp_path), experts_a=8, experts_b=24, moe_intermediate=1536, timeout_s=300)
    summary = result["summary"]
    assert summary["difference_bytes"] > 100 << 20
    assert all(summary["criteria"].values()), summary
    assert all(0.4 < g for g in summary["rank_peak_anon_growth_over_difference"]), summary  # it did load its half
