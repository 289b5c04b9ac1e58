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
from splash_rollout.engine.sampler import sample
from splash_rollout.engine.scheduler import Scheduler, ScheduledSeq
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
        shards = [slice_projections(layer.self_attn, slice(0, config.num_heads)) for layer in model.model.layers]
        self.runner = ModelRunner(model, SingleRankExecutor(self.pool, get_backend(attention_backend), shards))
        self.num_steps = 0

    def add_request(self, request: Request) -> None:
        self.scheduler.add(request)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[Request]:
        """One engine step; returns the requests that finished in it."""
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
        return sample(logits, [r.spec for r in samplers], [r.generator for r in samplers])

    def run_until_done(self) -> list[Request]:
        finished: list[Request] = []
        while self.scheduler.has_unfinished:
            finished.extend(self.step())
        return finished

    def abort_all(self) -> list[Request]:
        return self.scheduler.abort_all()
