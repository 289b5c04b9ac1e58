"""The device check's python on the CPU (``--cpu --tiny``): parts write JSON, one part's failure is
recorded with its traceback and does not stop the next, unknown parts are refused by name."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

os.environ["TRITON_INTERPRET"] = "1"  # the CPU run executes the Triton kernels in the interpreter
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_script():
    spec = importlib.util.spec_from_file_location("device_check", os.path.join(ROOT, "scripts", "device_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_tiny_parts_write_json_and_failures_are_recorded(tmp_path, monkeypatch, capsys):
    script = load_script()

    def broken(ctx):
        raise RuntimeError("planted failure")

    monkeypatch.setitem(script.PART_FUNCS, "env", broken)
    assert script.main(["--cpu", "--tiny", "--parts", "env,sharded_load,kernel_bandwidth", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "device_check.json").read_text())
    env, bandwidth = report["parts"]["env"], report["parts"]["kernel_bandwidth"]
    assert env["status"] == "error" and "planted failure" in env["traceback"]
    assert bandwidth["status"] == "ok"
    load = report["parts"]["sharded_load"]
    assert load["status"] == "ok" and load["result"]["generated_tokens"] > 0, load
    assert load["result"]["weights_bytes"] > 0
    for row in bandwidth["result"].values():
        assert row["triton"]["seconds"] > 0 and row["torch"]["gb_per_s"] > 0
        if importlib.util.find_spec("flash_mla") is None:  # the CPU machines: the reason names the wheel
            assert row["flashmla"]["status"] == "unavailable" and "sgl-flash-mla" in row["flashmla"]["why"]
    assert "kernel_bandwidth: ok" in capsys.readouterr().out


def test_unknown_part_is_named():
    with pytest.raises(SystemExit):
        load_script().parse_args(["--parts", "env,warp_drive"])
