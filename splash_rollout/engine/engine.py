"""Engine: the single-process step loop -- schedule → run → postprocess.

Owns the page manager, KV pool, scheduler, model runner and sampler for one rank. The rollout layer
(``splash_rollout.rollout.engine.RolloutEngine``) turns prompts and SamplingParams into Requests and
reads the finished ones back.
"""
from __future__ import annotations

import torch

from splash_rollout.engine.attention import get_backend
from splash_rollout.engine.executors.single import SingleRankExecutor
from splash_rollout.engine.forward_batch import ForwardBatch
from splash_rollout.engine.kv_pool import KVPool, KVPoolSpec
from splash_rollout.engine.model_runner import ModelRunner
from splash_rollout.engine.placement import KVPlacement
from splash_rollout.engine.projections import slice_projections
from splash_rollout.engine.request import Request
from splash_rollout.engine.sampler import SamplingBatch, sample
from splash_rollout.engine.scheduler import Scheduler, ScheduledSeq
from splash_rollout.engine.sleep import TensorOffload, memory_stats, release_memory, restore_memory
from splash_rollout.layout.layouts import Layout
from splash_rollout.models.config import ModelConfig


class Engine:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, *, num_pages: int, page_size: int = 16,
                 max_num_batched_tokens: int = 512, max_num_seqs: int = 256,
                 attention_backend: str = "torch_ref", dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", pool_spec: KVPoolSpec | None = None) -> None:
        """pool_spec: what this rank caches per token (a rank view's local numbers); default: the
        whole model's latent cache, which is what a single rank holds."""
        self.config = config
        self.device = torch.device(device)
        self.page_size = page_size
        self.placement = KVPlacement([num_pages], page_size, Layout.TP)
        self.pages = self.placement.managers[0]
        self.pool = KVPool(pool_spec or KVPoolSpec.from_model(config), num_pages, page_size, dtype, device)
        self.scheduler = Scheduler(self.placement, max_num_batched_tokens, max_num_seqs)
        self.shards = [slice_projections(layer.self_attn, slice(0, config.num_heads)) for layer in model.model.layers]
        """All heads: views of the modules' own weights."""
        self.model = model
        self.runner = ModelRunner(model, SingleRankExecutor(self.pool, get_backend(attention_backend), self.shards))
        self.num_steps = 0
        self._offload: TensorOffload | None = None

    def add_request(self, request: Request) -> None:
        self.scheduler.add(request)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[Request]:
        """One engine step; returns the requests that finished in it."""
        if self.asleep:
            raise RuntimeError("step: the engine is asleep; call wake_up() first")
        scheduled = self.scheduler.schedule()
        if not scheduled:
            raise RuntimeError("step: nothing schedulable although requests are pending")
        tokens, logprobs = self.run(scheduled)
        return self.scheduler.postprocess(scheduled, tokens, logprobs)

    def run(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor]:
        batch = ForwardBatch.build(
            [(s.request.token_ids, s.start, s.num_new, s.request.pages, s.samples) for s in scheduled],
            self.page_size, self.device)
        logits = self.runner.forward(batch)  # [R, V]
        samplers = [s.request for s in scheduled if s.samples]
        self.num_steps += 1
        return sample(logits, SamplingBatch.make([r.spec for r in samplers], [r.num_output_tokens for r in samplers],
                                                 logits.device))

    def run_until_done(self) -> list[Request]:
        finished: list[Request] = []
        while self.scheduler.has_unfinished:
            finished.extend(self.step())
        return finished

    def abort_all(self) -> list[Request]:
        return self.scheduler.abort_all()

    # ---- sleep / wake (engine/sleep.py) ---------------------------------------------------------
    @property
    def asleep(self) -> bool:
        return self._offload is not None

    def sleep(self) -> None:
        """Free the KV pool and move the weights out of tensor memory; refused while requests are
        queued or running (abort or finish them first)."""
        if self.asleep:
            raise RuntimeError("sleep: the engine is already asleep")
        if self.scheduler.has_unfinished:
            raise RuntimeError("sleep: requests are still queued or running; abort them or let them finish first")
        self._offload = release_memory(self.pool, self.model, self.shards)

    def wake_up(self) -> None:
        if not self.asleep:
            raise RuntimeError("wake_up: the engine is not asleep")
        restore_memory(self._offload, self.pool)
        self._offload = None

    def memory_stats(self) -> dict[str, int | None]:
        """Measured bytes: ``tracked_bytes`` (= the KV pool plus the projection weights),
        ``kv_pool``, ``weights`` (allocated storages under every weight tensor) and the process ``rss``."""
        shards = 0 if self.asleep else sum(x.nbytes for x in self.shards)
        return memory_stats(self.pool, self.model, self.shards, shards + self.pool.nbytes)
