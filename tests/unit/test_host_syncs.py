"""A decode step with no host syncs and fixed shapes (the GPU attention path, counted on the CPU).

``HostSyncs`` counts what would make a CUDA step wait: host reads (``item``, ``bool``, ``tolist``,
``cpu`` ...) and data-dependent ops (``nonzero``, boolean-mask indexing, ``unique``,
``repeat_interleave`` without an output size). A T = 1 decode step on the ``torch`` and ``triton``
(interpreted) backends makes one -- reading the sampled tokens back -- and none in the forward; two
padded decode steps of different batch sizes in one bucket run the same ops on the same shapes and
give the tokens the unpadded steps give; the routed experts' Triton path has no sync either.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels run on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

from splash_rollout.engine.rank_engine import Engine  # noqa: E402
from splash_rollout.rollout.build import engine_settings  # noqa: E402
from splash_rollout.rollout.config import EngineConfig  # noqa: E402
from splash_rollout.engine.host_syncs import HostSyncs  # noqa: E402
from splash_rollout.engine.request import Request, SamplingSpec  # noqa: E402
from splash_rollout.models.config import PRESETS  # noqa: E402
from splash_rollout.models.model import MLAForCausalLM  # noqa: E402
from splash_rollout.models.numerics import numerics  # noqa: E402

CFG = PRESETS["glm5-nano"]


def _requests(count: int, new_tokens: int = 4, start: int = 0) -> list[Request]:
    return [Request(start + i, [5 + i, 6, 7, 8, 9], SamplingSpec(temperature=1.0, max_new_tokens=new_tokens,
                                                                  ignore_eos=True, seed=10 + i), 4096)
            for i in range(count)]


def _engine(backend: str, buckets: tuple[int, ...] = ()) -> Engine:
    return Engine.single(MLAForCausalLM.from_config(CFG, seed=1), CFG,
                         engine_settings(EngineConfig(model=CFG, memory=dict(num_pages=64, page_size=16),
                                                      compute=dict(attention_backend=backend, decode_buckets=buckets,
                                                                   speculation="off", cpu_share=False))))


class StepCounter:
    """Counts every decode step of an engine: the whole step and its forward."""

    def __init__(self, engine: Engine, record_ops: bool = False) -> None:
        self.engine, self.record_ops = engine, record_ops
        self.steps: list[tuple[HostSyncs, HostSyncs, int]] = []
        self._step, self._forward = engine._step, engine._forward
        engine._step, engine._forward = self.step, self.forward
        self._current: HostSyncs | None = None

    def decoding(self) -> bool:
        s = self.engine.scheduler
        return bool(s.running) and not s.waiting and all(r.num_output_tokens > 0 for r in s.running)

    def step(self, *args, **kwargs):
        if not self.decoding():
            return self._step(*args, **kwargs)
        whole, self._current = HostSyncs(), HostSyncs(record_ops=self.record_ops)
        requests = len(self.engine.scheduler.running)
        with whole:
            out = self._step(*args, **kwargs)
        self.steps.append((whole, self._current, requests))
        self._current = None
        return out

    def forward(self, batch, order):
        if self._current is None:
            return self._forward(batch, order)
        with self._current:
            return self._forward(batch, order)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_decode_step_reads_the_device_once_and_its_forward_never(backend):
    engine = _engine(backend)
    counter = StepCounter(engine)
    engine.serve(_requests(3))
    assert len(counter.steps) >= 2
    for whole, forward, _ in counter.steps:
        assert forward.count == 0, dict(forward.sites)
        assert whole.count <= 2, dict(whole.sites)  # the sampled tokens (and logprobs) come back


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_decoder_of_a_padded_step_syncs_nothing_and_uploads_nothing(backend):
    """What a CUDA graph captures: no host read, no data-dependent op, no tensor made from host data."""
    engine = _engine(backend, buckets=(8,))
    seen, hidden = [], engine.runner.hidden

    def counted(batch, before_layer=None):
        with HostSyncs() as syncs:
            out = hidden(batch, before_layer)
        if batch.num_real is not None:
            seen.append(syncs)
        return out

    engine.runner.hidden = counted
    engine.serve(_requests(5))
    assert seen
    for syncs in seen:
        # native/ holds the CPU's own kernels (a table of weight addresses per call), which no GPU step runs
        uploads = {site: n for site, n in syncs.uploads.items() if " @ native/" not in site}
        assert syncs.count == 0 and not uploads, (dict(syncs.sites), uploads)


def test_the_counter_sees_what_would_sync():
    x = torch.arange(6)
    with HostSyncs() as syncs:
        int(x[0])
        x.tolist()
        x[x > 2]
        torch.nonzero(x)
        torch.repeat_interleave(x, x)
        torch.repeat_interleave(x, x, output_size=15)  # told its size: no sync
        x.to("cpu")  # not seen (a host-to-device copy looks the same on a CPU machine): the convention is .cpu()
    assert syncs.count == 5, dict(syncs.sites)
    assert all("test_host_syncs.py" not in site for site in syncs.sites)  # sites name package lines only


def _decode_ops(requests: int) -> list:
    """The ops (with their shapes) of the decoder in each decode step: what a CUDA graph replays (the LM
    head and the sampler run outside it, on the real rows)."""
    engine = _engine("torch", buckets=(4, 8))
    recorded, hidden = [], engine.runner.hidden

    def recording(batch, before_layer=None):
        if batch.num_real is None:
            return hidden(batch, before_layer)
        with HostSyncs(record_ops=True) as syncs:
            out = hidden(batch, before_layer)
        recorded.append(syncs.ops)
        return out

    engine.runner.hidden = recording
    engine.serve(_requests(requests, new_tokens=3))
    return recorded


def test_decode_steps_of_one_bucket_run_the_same_ops_on_the_same_shapes():
    five, seven = _decode_ops(5), _decode_ops(7)
    assert five and seven
    assert five[0] == seven[0]  # both padded to 8 requests, keys to one page
    assert len(five[0]) > 100
    two = _decode_ops(2)
    assert two[0] != five[0]  # another bucket, other shapes


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_decode_steps_give_the_unpadded_tokens(backend):
    mode = "reproducible" if backend == "torch" else "fast"
    with numerics(mode):
        got = {}
        for buckets in ((), (4, 8)):
            finished = _engine(backend, buckets).serve(_requests(5, new_tokens=6))
            got[buckets] = {r.request_id: (r.output_ids, r.output_logprobs) for r in finished}
    plain, padded = got[()], got[(4, 8)]
    assert {k: v[0] for k, v in plain.items()} == {k: v[0] for k, v in padded.items()}
    for k in plain:
        tol = 0.0 if mode == "reproducible" else 1e-4
        assert all(abs(a - b) <= tol for a, b in zip(plain[k][1], padded[k][1]))


def test_routed_experts_on_the_device_path_have_no_sync_and_the_loops_values():
    from splash_rollout.models.moe import DenseMLP, run_experts, stack_experts
    from splash_rollout.models.triton_moe import fused_experts

    torch.manual_seed(0)
    experts = torch.nn.ModuleList(DenseMLP(32, 24) for _ in range(6))
    x, idx, weight = torch.randn(9, 32), torch.randint(0, 8, (9, 2)), torch.rand(9, 2)
    with torch.no_grad():
        expected = run_experts(x.double(), idx, weight.double(), experts.double(), first_expert=2).float()
        experts.float()
        stacks = stack_experts(experts, "cpu")
        with HostSyncs() as syncs:
            got = fused_experts(x, idx, weight, *stacks, first_expert=2)
    assert syncs.count == 0, dict(syncs.sites)
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)
    assert experts[3].gate_proj.weight.data_ptr() == stacks[0][3].data_ptr()  # the experts view the stacks
