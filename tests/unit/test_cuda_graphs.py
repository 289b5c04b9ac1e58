"""The decode-graph bookkeeping, driven on the CPU: a graph's own inputs, its keys per (layout, bucket,
width), invalidation when the pool's tensors are replaced, and the first-replay check.

Without CUDA the graph is the decoder run again on the graph's own inputs (``capture="eager"``):
everything but the CUDA capture runs -- the padded batch a graph owns, the copy of a step's inputs
into it, the key a step picks, recapture after sleep and wake, the fallback to eager with one
warning when a first replay differs. ``scripts/device_check.py`` (part ``cuda_graph``) runs the real
graphs on a GPU.
"""
from __future__ import annotations

import pytest
import torch

from splash_rollout import EngineConfig
from splash_rollout.engine import cuda_graphs
from splash_rollout.engine.cuda_graphs import DecodeGraphs, GraphKey, decode_buckets, width_buckets
from splash_rollout.engine.rank_engine import Engine
from splash_rollout.rollout.build import engine_settings
from splash_rollout.engine.request import Request, SamplingSpec
from splash_rollout.layout import Layout
from splash_rollout.models.config import PRESETS
from splash_rollout.models.model import MLAForCausalLM
from splash_rollout.models.numerics import numerics

CFG = PRESETS["glm5-nano"]
BUCKETS = (4, 8)
MAX_LEN = 64


def _requests(count: int, new_tokens: int = 6) -> list[Request]:
    return [Request(i, [5 + i, 6, 7, 8, 9, 10 + i], SamplingSpec(temperature=1.0, max_new_tokens=new_tokens,
                                                                   ignore_eos=True, seed=20 + i), MAX_LEN)
            for i in range(count)]


def _engine(graphs: bool, check: bool = True) -> Engine:
    settings = engine_settings(EngineConfig(model=dict(source=CFG, max_model_len=MAX_LEN),
                                            memory=dict(num_pages=64, page_size=16),
                                            compute=dict(attention_backend="torch", speculation="off", cpu_share=False,
                                                         decode_buckets=BUCKETS if graphs else ())))
    engine = Engine.single(MLAForCausalLM.from_config(CFG, seed=2), CFG, settings)
    if graphs:
        engine.graphs = DecodeGraphs(engine.runner.hidden, engine.block_table, engine.state.pool, engine.comm,
                                     engine.control, settings.memory.page_size, engine.buckets, MAX_LEN // 16, check=check,
                                     reserve_bytes=0, capture="eager")
        engine.graphs.capture_all(engine.layout, engine._graphable(engine.layout))
    return engine


def _outputs(finished) -> dict:
    return {r.request_id: (r.output_ids, r.output_logprobs) for r in finished}


def test_buckets_and_widths():
    assert decode_buckets(256)[:4] == (1, 2, 4, 8) and decode_buckets(256)[-1] == 256
    assert decode_buckets(40) == (1, 2, 4, 8, 16, 24, 32, 40)
    assert width_buckets(1) == (1,) and width_buckets(5) == (1, 2, 4, 8) and width_buckets(8) == (1, 2, 4, 8)


def test_graphed_decode_steps_give_the_eager_tokens_bit_for_bit():
    with numerics("reproducible"):
        eager = _outputs(_engine(False).serve(_requests(6)))
        engine = _engine(True)
        assert set(engine.graphs.graphs) == {GraphKey(Layout.TP, b, p) for b in BUCKETS for p in (1, 2, 4)}
        graphed = _outputs(engine.serve(_requests(6)))
    assert graphed == eager
    assert engine.graphs.replays >= 5 and engine.graphs.disabled is None


def test_sleep_and_wake_recapture_and_keep_the_tokens():
    with numerics("reproducible"):
        engine = _engine(True)
        first = _outputs(engine.serve(_requests(3)))
        engine.sleep()
        engine.wake_up()
        assert not engine.graphs.graphs  # the pool and the weights moved: every graph was stale
        again = _outputs(engine.serve(_requests(3)))
    assert again == first
    assert engine.graphs.graphs  # the keys the second call used were captured again


def test_a_first_replay_that_differs_turns_graphs_off_and_the_step_keeps_the_eager_result(monkeypatch):
    # a graph that does not take a step's positions in (a bug of the graph's inputs) must not write a token
    monkeypatch.setattr(cuda_graphs, "STATIC_INPUTS", tuple(n for n in cuda_graphs.STATIC_INPUTS if n != "positions"))
    with numerics("reproducible"):
        eager = _outputs(_engine(False).serve(_requests(5)))
        engine = _engine(True, check=True)
        with pytest.warns(UserWarning, match="cuda graphs turned off: the first replay"):
            graphed = _outputs(engine.serve(_requests(5)))
    assert graphed == eager
    assert engine.graphs.disabled and not engine.graphs.graphs


def test_cuda_graphs_on_is_refused_off_cuda():
    with pytest.raises(ValueError, match="cuda_graphs='on' needs parallel.device='cuda'"):
        EngineConfig(compute={"cuda_graphs": "on"})
    auto = engine_settings(EngineConfig(model=CFG, memory=dict(num_pages=8),
                                        compute=dict(cuda_graphs="auto", speculation="off")))
    engine = Engine.single(MLAForCausalLM.from_config(CFG, seed=0), CFG, auto)
    assert engine.graphs is None and engine.buckets == ()  # auto: nothing changes on the CPU
    assert engine.memory_stats()["cuda_graphs"] == 0
