"""Smoke tests of the measured benchmarks (benchmarks/*.py): they run end to end on spawned ranks,
write the contract keys, and count samples and admissions right. No timing is asserted: speed lives
in the benchmarks' JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _run(script: str, *args: str) -> None:
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_rollout_drain_quick(tmp_path):
    out, png = tmp_path / "drain.json", tmp_path / "drain.png"
    # one fixed layout, auto and the peers: the contract of every key, without spawning every layout
    _run("rollout_drain.py", "--json", str(out), "--png", str(png), "--quick",
         "--systems", "dp,auto,transformers,transformers_cb")
    r = json.loads(out.read_text())
    # transformers' continuous batching either runs (and is checked like the rest) or says why not
    assert set(r["unavailable"]) <= {"transformers_cb"} and all(r["unavailable"].values())
    systems = {"dp", "auto", "transformers", "transformers_cb"} - set(r["unavailable"])
    assert set(r["tokens_per_s"]) == systems
    if "transformers_cb" in systems:
        assert r["ratio_auto_vs_transformers_cb"] == pytest.approx(r["tokens_per_s"]["auto"]
                                                                   / r["tokens_per_s"]["transformers_cb"])
    else:
        assert r["ratio_auto_vs_transformers_cb"] is None and "transformers_cb" not in r["runs"]
    assert all(v > 0 for v in r["tokens_per_s"].values())
    best = r["tokens_per_s"]["dp"]
    assert r["ratio_auto_vs_best_fixed"] == pytest.approx(r["tokens_per_s"]["auto"] / best)
    w = r["workload"]
    assert w["num_samples"] == w["num_prompts"] * w["n"] == len(w["prompt_lens"]) * w["n"]
    assert w["response_tokens"] == w["n"] * sum(w["response_lens"])
    for name in systems:
        run = r["runs"][name]
        assert run["samples"] == w["num_samples"] and run["tokens"] == w["response_tokens"]
        assert run["wall_s"] > 0
    for name in systems - {"transformers", "transformers_cb"}:
        run = r["runs"][name]
        assert run["steps"] >= max(w["response_lens"]) and run["switches"] >= 0
        assert sum(p["steps"] for p in run["phases"]) == run["steps"]
    for name in ("dp",):  # a fixed layout never switches
        assert r["runs"][name]["switches"] == 0 and {p["layout"] for p in r["runs"][name]["phases"]} == {name}
    assert png.stat().st_size > 0


def test_capacity_dop_admits_more_than_dp(tmp_path):
    out = tmp_path / "capacity.json"
    _run("capacity.py", "--json", str(out), "--systems", "dp,dop", "--requests", "8", "--max-new-tokens", "8",
         "--prompt-len", "120")
    r = json.loads(out.read_text())
    for name in ("dp", "dop"):
        row = r["layouts"][name]
        assert row["measured"]["finished"] == 8
        assert row["measured"]["max_running"] == row["predicted_max_running"]
    assert r["pool_tokens_per_rank"]["dop"] > r["pool_tokens_per_rank"]["dp"]
    assert r["max_running"]["dop"] > r["max_running"]["dp"]


def test_layout_sweep_small(tmp_path):
    out = tmp_path / "sweep.json"
    _run("layout_sweep.py", "--json", str(out), "--inputs", "16,32", "--batches", "2", "--output-len", "4",
         "--layouts", "dp,dop", "--repeats", "1")
    r = json.loads(out.read_text())
    assert set(r["leaders"]["B2"]) == {"16", "32"} and set(r["leaders"]["B2"].values()) <= {"dp", "dop"}
    for p in r["points"]:
        assert p["tokens_per_s"] == pytest.approx(p["batch"] * (p["input_len"] + 4) / p["batch_s"])


def test_numerics_cost_quick(tmp_path):
    out = tmp_path / "numerics.json"
    _run("numerics_cost.py", "--json", str(out), "--quick")
    r = json.loads(out.read_text())
    assert set(r["tokens_per_s"]) == {"fast", "reproducible"} and all(v > 0 for v in r["tokens_per_s"].values())
    assert r["slowdown"] == pytest.approx(r["tokens_per_s"]["fast"] / r["tokens_per_s"]["reproducible"])
    assert r["logprob_diff_max"]["reproducible"] <= 1e-6 and r["tokens_over_1e-5"]["reproducible"] == 0
    assert [x["numerics"] for x in r["rounds"]] == ["fast", "reproducible"]
    assert all(0 < x["tokens"] <= 4 * 2 * 24 for x in r["rounds"])  # 4 prompts x 2 samples, eos may stop early


def test_memory_layouts_quick(tmp_path):
    out = tmp_path / "memory.json"
    # the default quick budget must hold every quick prompt in every layout (at 2 MiB DP-attention's could not)
    _run("memory.py", "--json", str(out), "--quick", "--parts", "layouts", "--layouts", "dp,auto")
    part = json.loads(out.read_text())["layouts"]
    runs = part["runs"]
    assert set(runs) == {"dp", "auto"} and part["best_fixed"] == "dp"
    assert runs["dp"]["tokens"] > 0 and runs["auto"]["tokens"] > 0
    assert runs["dp"]["switches"] == [] and runs["dp"]["switch_decisions"] == []
    first = runs["auto"]["switch_decisions"][0]
    assert first["current"] is None and first["chosen"] in ("tp", "cp", "dp", "dop")
    assert part["ratio_auto_vs_dp"] == pytest.approx(runs["auto"]["tokens_per_s"] / runs["dp"]["tokens_per_s"])
