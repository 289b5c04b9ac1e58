"""`python -m splash_rollout.layout`: the JSON contract and one-line errors with exit code 2."""
import json
import subprocess
import sys

import pytest

from splash_rollout.layout.__main__ import main


def _json(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_footprint_json_contract(capsys):
    out = _json(capsys, "footprint", "--model", "deepseek-v3.2", "--world-size", "8", "--memory-gib", "141",
                "--mem-fraction", "0.9")
    assert set(out["layouts"]) == {"tp", "cp", "dp", "dop"}
    for fp in out["layouts"].values():
        assert {"weight_bytes_per_rank", "kv_bytes_per_token", "pool_tokens_per_rank", "distinct_tokens"} <= set(fp)
        assert fp["kv_bytes_per_token"] == 48_068
    assert out["layouts"]["dop"]["distinct_tokens"] > out["layouts"]["dp"]["distinct_tokens"]


def test_switches_json_contract(capsys):
    out = _json(capsys, "switches", "--model", "glm-5", "--world-size", "8", "--batch", "16", "--context", "262144")
    rows = out["switches"]
    assert len(rows) == 12
    for row in rows:
        assert {"src", "dst", "weights", "kv", "bytes_per_rank", "network"} <= set(row)
        assert row["weights"] in {"keep", "discard", "all_gather", "all_to_all"}
        assert row["kv"] in {"keep", "discard", "all_gather", "all_to_all"}
    zero = {(r["src"], r["dst"]) for r in rows if r["bytes_per_rank"] == 0}
    assert zero == {("tp", "dop"), ("dp", "dop")}


def test_limits_from_footprint_options(capsys):
    out = _json(capsys, "limits", "--world-size", "2", "--batch", "4", "--model", "glm5-nano", "--memory-gib", "0.01",
                "--mem-fraction", "1", "--attention-only", "--weight-dtype", "fp32", "--kv-format", "fp32",
                "--page-size", "16", "--cohorts", "500")
    assert set(out["limits"]) == {"tp", "cp", "dp", "dop"}
    assert out["limits"]["dop"] >= out["limits"]["dp"] > 0


@pytest.mark.parametrize("argv,option", [
    (["footprint", "--model", "nope", "--world-size", "8", "--memory-gib", "80"], "--model"),
    (["footprint", "--model", "glm-5", "--world-size", "3", "--memory-gib", "80"], "--world-size"),
    (["footprint", "--model", "glm-5", "--world-size", "8", "--memory-gib", "-1"], "--memory-gib"),
    (["footprint", "--model", "glm-5", "--world-size", "0", "--memory-gib", "80"], "--world-size"),
    (["switches", "--model", "glm-5", "--world-size", "8", "--batch", "x", "--context", "1"], "--batch"),
    (["limits", "--world-size", "8", "--batch", "4", "--pool-tokens", "tp=1,dp=2"], "--pool-tokens"),
    (["limits", "--world-size", "8", "--batch", "4", "--pool-tokens", "tp=1,dp=2,cp=3,xx=4"], "--pool-tokens"),
    (["limits", "--world-size", "8", "--batch", "4"], "--pool-tokens"),
    (["footprint", "--model", "glm-5", "--world-size", "8", "--memory-gib", "80", "--kv-format", "int4"], "--kv-format"),
])
def test_bad_input_is_one_line_naming_the_option(capsys, argv, option):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and option in err, err


def test_module_entry_point_exit_code():
    proc = subprocess.run([sys.executable, "-m", "splash_rollout.layout", "footprint", "--model", "glm-5",
                           "--world-size", "3", "--memory-gib", "80"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--world-size" in proc.stderr and proc.stdout == ""
