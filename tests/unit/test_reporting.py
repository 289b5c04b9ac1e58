"""Reporting: sinks share one interface, W&B offline holds the metrics, timeline JSON / PNG / records."""
import glob
import inspect
import json
import os

import pytest

from splash_rollout.engine.step_log import StepRecord
from splash_rollout.reporting import JsonlSink, MetricsSink, MultiSink, NoOpSink, RolloutProgress, make_sink
from splash_rollout.reporting.timeline_report import TABLE_COLUMNS, layout_metrics, plot_timeline, table_rows, \
    write_timeline_json

TIMELINE = {"phases": [{"layout": "dp", "t_start": 0.0, "t_end": 3.0, "steps": 30, "batch_size_start": 64,
                        "batch_size_end": 9, "tokens": 1200},
                       {"layout": "dop", "t_start": 3.0, "t_end": 4.0, "steps": 40, "batch_size": 9, "tokens": 200}],
            "switches": [{"src": "dp", "dst": "dop", "step": 30, "bytes_sent": 10, "bytes_received": 12,
                          "overhead_ms": 1.5, "blocking_estimate_ms": 4.0, "deferred_reason": None},
                         {"src": "dop", "dst": "tp", "step": 50, "bytes_sent": None, "bytes_received": None,
                          "overhead_ms": None, "blocking_estimate_ms": None, "deferred_reason": "headroom"}]}


def _public_methods(cls):
    return {n: inspect.signature(f) for n, f in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}


def test_noop_sink_has_the_wandb_sinks_methods():
    from splash_rollout.reporting.wandb_sink import WandbSink

    wandb_methods, noop_methods = _public_methods(WandbSink), _public_methods(NoOpSink)
    for name in ("log", "log_table", "log_image", "finish"):
        assert name in noop_methods and name in wandb_methods
        assert list(noop_methods[name].parameters) == list(wandb_methods[name].parameters)
    assert issubclass(WandbSink, MetricsSink) and issubclass(NoOpSink, MetricsSink)
    NoOpSink().log({"a/b": 1.0}, step=0)  # and does nothing


def test_layout_metrics_from_phases_and_switches():
    m = layout_metrics(TIMELINE)
    assert m["layout/time_share/dp"] == pytest.approx(0.75) and m["layout/time_share/dop"] == pytest.approx(0.25)
    assert m["layout/switches"] == 1.0 and m["layout/deferred_switches"] == 1.0
    assert m["layout/switch_overhead_ms"] == 1.5 and m["layout/switch_bytes"] == 12
    per_rank = {"phases": TIMELINE["phases"], "switches": [dict(TIMELINE["switches"][0], bytes_received=[5, 7])]}
    assert layout_metrics(per_rank)["layout/switch_bytes"] == 12
    today = layout_metrics({"phases": [{"layout": "tp", "t_start": 0.0, "t_end": 2.0, "steps": 5, "batch_size": 4,
                                        "tokens": 10}], "switches": []})
    assert today == {"layout/time_share/tp": 1.0, "layout/switches": 0.0, "layout/deferred_switches": 0.0,
                     "layout/switch_overhead_ms": 0.0, "layout/switch_bytes": 0.0, "layout/pressure_switches": 0.0}
    pressured = {"phases": TIMELINE["phases"], "switches": [dict(TIMELINE["switches"][0], cause="pressure")]}
    assert layout_metrics(pressured)["layout/pressure_switches"] == 1.0


def test_timeline_json_rows_and_png(tmp_path):
    tls = [(0, TIMELINE), (1, TIMELINE)]
    write_timeline_json(str(tmp_path / "timeline.json"), tls)
    data = json.loads((tmp_path / "timeline.json").read_text())
    assert [s["step"] for s in data["steps"]] == [0, 1] and data["steps"][1]["phases"][1]["layout"] == "dop"
    rows = table_rows(0, TIMELINE)
    assert len(rows) == 2 and len(rows[0]) == len(TABLE_COLUMNS)
    fleet_call = {"phases": [{**p, "replica": r} for r, p in enumerate(TIMELINE["phases"])]}
    assert [row[TABLE_COLUMNS.index("replica")] for row in table_rows(0, fleet_call)] == [0, 1]
    assert rows[0][5:7] == [64, 9] and rows[1][5:7] == [9, 9] and rows[0][TABLE_COLUMNS.index("tokens_per_s")] == pytest.approx(400.0)
    png = plot_timeline(str(tmp_path / "timeline.png"), tls)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(png) > 5000


def test_jsonl_and_make_sink_rank_rule(tmp_path):
    assert isinstance(make_sink("wandb", rank=1, run_dir=str(tmp_path)), NoOpSink)
    sink = make_sink("none", rank=0, run_dir=str(tmp_path))
    assert isinstance(sink, JsonlSink)
    sink.log({"reward/mean": 0.5}, step=3)
    sink.finish()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 3, "reward/mean": 0.5}
    with pytest.raises(ValueError, match="logger kind"):
        make_sink("tensorboard", rank=0, run_dir=str(tmp_path))


def test_wandb_offline_run_holds_metrics_table_and_image(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    png = plot_timeline(str(tmp_path / "timeline.png"), [(0, TIMELINE)])
    sink = make_sink("wandb", rank=0, run_dir=str(tmp_path), project="test", mode="offline")
    assert isinstance(sink, MultiSink)
    sink.log({"reward/mean": 0.25, "layout/switches": 1.0}, step=0)
    sink.log({"reward/mean": 0.5, "layout/switches": 1.0}, step=1)
    sink.log_table("timeline/phases", TABLE_COLUMNS, table_rows(1, TIMELINE), step=1)
    sink.log_image("timeline/plot", png, step=1)
    sink.finish()
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    assert len(runs) == 1
    assert glob.glob(os.path.join(runs[0], "run-*.wandb"))
    [table] = glob.glob(os.path.join(runs[0], "files", "media", "table", "timeline", "phases_*.table.json"))
    written = json.loads(open(table).read())  # the rows themselves, not only a file
    assert written["columns"] == list(TABLE_COLUMNS)
    assert written["data"] == [list(r) for r in table_rows(1, TIMELINE)] and len(written["data"]) >= 1
    [image] = glob.glob(os.path.join(runs[0], "files", "media", "images", "timeline", "plot_*.png"))
    assert open(image, "rb").read() == open(png, "rb").read()
    # the run's record log (protobuf records, uncompressed) holds every logged key and value
    path = glob.glob(os.path.join(runs[0], "run-*.wandb"))[0]
    log = open(path, "rb").read()
    assert b"reward/mean" in log and b"0.25" in log and b"0.5" in log and b"layout/switches" in log
    assert b"timeline/phases" in log and b"table-file" in log
    assert b"timeline/plot" in log and b"image-file" in log


def test_progress_bar_disabled_is_noop_and_enabled_counts(capsys):
    with RolloutProgress(total=4, enabled=False) as p:
        p.update(2, layout="dp", tokens=10)
    with RolloutProgress(total=4, enabled=True) as p:
        p.update(1, layout="dp", tokens=10)
        p.update(4, layout="dop", tokens=50)
        assert p._bar.n == 4 and p.tokens_per_s > 0


def test_phases_keep_the_drain_shape_in_a_few_points():
    from splash_rollout.rollout.call_timeline import phases_from_steps

    running = [128, 120, 100, 90, 60, 40, 39, 20, 5, 3, 2, 1, 1, 1, 0]
    steps = [StepRecord(i, "dp" if i < 10 else "dop", seconds=0.5, requests=r, running=r, rows=r)
             for i, r in enumerate(running)]
    dp, dop = phases_from_steps(steps)
    # a point each time the batch moved by a fifth of the last point, plus the start and the end
    assert dp["batch_curve"] == [[0.0, 128], [1.5, 100], [2.5, 60], [3.0, 40], [4.0, 20], [4.5, 5], [5.0, 3]]
    assert dop["batch_curve"] == [[5.0, 2], [6.0, 1], [7.5, 0]]
    assert (dp["batch_size_start"], dp["batch_size_end"], dop["t_end"]) == (128, 3, 7.5)
    refill = [StepRecord(i, "dop", seconds=1.0, requests=r, running=r, rows=r) for i, r in enumerate((10, 5, 5, 9, 10, 0))]
    (phase,) = phases_from_steps(refill)  # admission refills the batch from the queue: kept too
    assert phase["batch_curve"] == [[0.0, 10], [2.0, 5], [4.0, 9], [6.0, 0]]
