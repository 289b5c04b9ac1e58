"""The engine on a GPU: every engine tensor on the device, and the same greedy tokens as on CPU.

Skipped where CUDA is missing (CI); run on a GPU machine with ``python -m pytest tests/gpu``."""
from __future__ import annotations

import pytest
import torch

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[5, 6, 7] * 20, [9] * 3, list(range(3, 90))]
GREEDY = SamplingParams(n=2, temperature=0.0, max_new_tokens=12, ignore_eos=True)


def tokens(batch):
    return [s.response_ids for s in batch.samples]


def test_engine_tensors_live_on_the_device_and_tokens_match_cpu():
    with RolloutEngine(EngineConfig(model="glm5-nano", device="cpu", memory_budget_gib=0.05)) as cpu:
        want = tokens(cpu.generate(PROMPTS, GREEDY))
    with RolloutEngine(EngineConfig(model="glm5-nano", device="cuda", memory_budget_gib=0.05)) as gpu:
        engine = gpu.local_engine
        assert all(t.is_cuda for t in engine.state.pool.kv)
        assert engine.block_table.table.is_cuda
        assert all(p.is_cuda for p in engine.model.parameters())
        assert tokens(gpu.generate(PROMPTS, GREEDY)) == want


@pytest.mark.parametrize("backend", ["torch", "torch_ref"])
def test_backends_on_cuda(backend):
    cfg = dict(model="glm5-nano", memory_budget_gib=0.05, attention_backend=backend)
    with RolloutEngine(EngineConfig(device="cpu", **cfg)) as cpu, RolloutEngine(EngineConfig(device="cuda", **cfg)) as gpu:
        a, b = cpu.generate(PROMPTS, GREEDY), gpu.generate(PROMPTS, GREEDY)
    assert tokens(a) == tokens(b)
    worst = max(abs(x - y) for s, t in zip(a.samples, b.samples) for x, y in zip(s.response_logprobs, t.response_logprobs))
    assert worst < 1e-4


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_graphed_decode_gives_the_eager_tokens_and_syncs_nothing(backend):
    pytest.importorskip("triton") if backend == "triton" else None
    cfg = dict(model="glm5-nano", device="cuda", memory_budget_gib=0.05, attention_backend=backend, speculation="off",
               max_model_len=512)
    with RolloutEngine(EngineConfig(**cfg, cuda_graphs="off")) as eager:
        want = eager.generate(PROMPTS, GREEDY)
    with RolloutEngine(EngineConfig(**cfg, cuda_graphs="on")) as graphed:
        engine = graphed.local_engine
        assert engine.graphs is not None and engine.graphs.graphs  # captured at start
        forward = engine._forward

        def no_sync(batch, order):
            if batch.num_real is None:
                return forward(batch, order)
            torch.cuda.set_sync_debug_mode("error")  # any sync in a graphed decode step raises
            try:
                return forward(batch, order)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        engine._forward = no_sync
        got = graphed.generate(PROMPTS, GREEDY)
        assert engine.graphs.replays > 0 and engine.graphs.disabled is None
    assert tokens(got) == tokens(want)
