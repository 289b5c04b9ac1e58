"""Simulator: sweep shape and plausibility, drain conservation and adaptive >= best fixed, CLI."""
import json

import numpy as np
import pytest

from splash_rollout.scheduling import Deployment
from splash_rollout.sim import ADAPTIVE, SimConfig, Workload, drain, drain_workload, simulate, sweep
from splash_rollout.sim.__main__ import main


@pytest.fixture(scope="module")
def dep():
    return Deployment.build("glm-5", "b200")


def test_sweep_shape_and_plausibility(dep):
    out = sweep(dep, 16, (1024, 16384))
    assert set(out["leaders"]) == {"1024", "16384"}
    for length, row in out["tokens_per_s"].items():
        assert set(row) == {"tp", "cp", "dp", "dop"}
        assert out["leaders"][length] == max(row, key=row.get)
        assert all(0 < v < 1e6 for v in row.values())
    # longer inputs carry more tokens per second of batch time (prefill is cheaper per token)
    assert out["tokens_per_s"]["16384"]["dp"] > out["tokens_per_s"]["1024"]["dp"]


def test_sweep_runs_in_waves_when_the_pool_is_short(dep):
    work = Workload.make([500_000] * 16, 1024)
    r = simulate(work, dep, "dp")  # DP-attention holds one 501K request per owner: two waves
    assert r.tokens == work.total_tokens and np.isfinite(r.finish_time).all()
    assert r.timeline[0]["batch_max"] == 8


def test_a_request_no_layout_can_hold_scores_zero(dep):
    r = simulate(Workload.make([2_000_000], 16), dep, "tp")
    assert r.tokens_per_s == 0.0 and "does not fit" in r.reason


@pytest.fixture(scope="module")
def small_drain(dep):
    work = drain_workload(prompts=24, samples=8, prompt_len=(1024, 4096), response_lognormal=(7.5, 1.2),
                          max_response=32768, seed=3)
    return work, drain(dep, work, SimConfig(max_running=256))


def test_drain_conservation(small_drain, dep):
    work, out = small_drain
    for mode, run in out["runs"].items():
        assert run["tokens"] == work.total_tokens, mode
    r = simulate(work, dep, ADAPTIVE, SimConfig(max_running=256))
    assert np.isfinite(r.finish_time).all() and r.finish_time.size == work.size
    assert sum(seg["tokens"] for seg in r.timeline) == work.total_tokens


def test_adaptive_is_not_worse_than_the_best_fixed_layout(small_drain):
    _, out = small_drain
    assert set(out["tokens_per_s"]) == {"tp", "cp", "dp", "dop", "adaptive"}
    assert out["ratio_adaptive_vs_best_fixed"] >= 0.99
    for s in out["switches"]:
        assert s["exposed_s"] <= s["blocking_s"] + 1e-12


def test_cli_sweep_json_and_errors(tmp_path, capsys):
    path = tmp_path / "s.json"
    assert main(["sweep", "--batch", "8", "--inputs", "1024", "--json", str(path), "--png",
                 str(tmp_path / "s.png")]) == 0
    data = json.loads(path.read_text())
    assert set(data) >= {"leaders", "tokens_per_s"} and (tmp_path / "s.png").stat().st_size > 0
    capsys.readouterr()
    for argv, option in ((["sweep", "--batch", "0"], "--batch"), (["sweep", "--inputs", "a"], "--inputs"),
                         (["drain", "--hardware", "nope"], "--hardware"), (["sweep", "--model", "x"], "--model"),
                         (["drain", "--response-lognormal", "1"], "--response-lognormal")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert option in err and "\n" not in err


def test_cli_drain_png(tmp_path):
    assert main(["drain", "--prompts", "4", "--samples", "4", "--prompt-len", "512", "--max-response", "2048",
                 "--response-lognormal", "6,0.5", "--json", str(tmp_path / "d.json"),
                 "--png", str(tmp_path / "d.png")]) == 0
    data = json.loads((tmp_path / "d.json").read_text())
    assert "ratio_adaptive_vs_best_fixed" in data and isinstance(data["timeline"], list)
