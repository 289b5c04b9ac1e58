"""RolloutEngine: the public face -- prompts and SamplingParams in, a RolloutBatch out.

Builds the model (preset: random init seeded by ``EngineConfig.seed``; folder: HF checkpoint), the
single-rank engine under it, and turns each (prompt, sample j) into an engine Request with its own
seed. All inputs are validated before any work starts. Multi-rank layouts arrive in later issues.
"""
from __future__ import annotations

import os
import time
from typing import Any, Sequence

import numpy as np
import torch

from splash_rollout.engine.engine import Engine
from splash_rollout.engine.kv_pool import KVPoolSpec
from splash_rollout.engine.request import Request, SamplingSpec
from splash_rollout.models.config import ModelConfig, PRESETS, resolve_model
from splash_rollout.rollout.config import EngineConfig
from splash_rollout.rollout.types import RolloutBatch, Sample, SampleGroup, SamplingParams, Timeline

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def derive_seed(*keys: int) -> int:
    """A well-mixed 63-bit seed from integer keys (distinct keys give distinct seeds w.h.p.)."""
    state = np.random.SeedSequence([int(k) & (2**64 - 1) for k in keys]).generate_state(2, np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1]))


class RolloutEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.world_size != 1:
            raise NotImplementedError(
                f"world_size: only 1 is implemented so far (got {config.world_size}); "
                "multi-rank layouts (TP/DP/DOP/CP) come with the distributed executors")
        from splash_rollout.models.model import MLAForCausalLM

        self.config = config
        if config.flush_denormal and torch.device(config.device).type == "cpu":
            torch.set_flush_denormal(True)
        self.model_config: ModelConfig = resolve_model(config.model)
        dtype = _TORCH_DTYPES[config.dtype]
        source = config.model
        if isinstance(source, (str, os.PathLike)) and os.fspath(source) not in PRESETS:
            self.model = MLAForCausalLM.from_pretrained(os.fspath(source), dtype=dtype)
        else:
            self.model = MLAForCausalLM.from_config(self.model_config, seed=config.seed, dtype=dtype)
        self.model.to(config.device).eval()
        self.max_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                           self.model_config.max_position_embeddings)
        num_pages = config.num_pages or KVPoolSpec.from_model(self.model_config).num_pages_for_budget(
            int(config.memory_budget_gib * 2**30), config.page_size, dtype)
        if num_pages < 1:
            raise ValueError(f"memory_budget_gib: {config.memory_budget_gib} GiB holds no page")
        self.engine = Engine(self.model, self.model_config, num_pages=num_pages, page_size=config.page_size,
                             max_num_batched_tokens=config.max_num_batched_tokens,
                             max_num_seqs=config.max_num_seqs, attention_backend=config.attention_backend,
                             dtype=dtype, device=config.device)
        self._tokenizer = None
        self._num_calls = 0
        self._next_request_id = 0
        self._closed = False

    # ---- tokenizer -----------------------------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from splash_rollout.models.tokenizer import load_tokenizer

            source = self.config.tokenizer or (self.config.model if not isinstance(self.config.model, ModelConfig)
                                               else self.model_config.name)
            self._tokenizer = load_tokenizer(os.fspath(source))
        return self._tokenizer

    # ---- generate ------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Any] | str,
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None) -> RolloutBatch:
        """One group of ``n`` samples per prompt (token-id list or string)."""
        if self._closed:
            raise RuntimeError("generate: the engine is shut down")
        requests, groups = self._make_requests(prompts, sampling)
        for req in requests:
            self.engine.add_request(req)
        t0 = time.perf_counter()
        steps0 = self.engine.num_steps
        max_batch = 0
        try:
            while self.engine.has_unfinished:
                self.engine.step()
                max_batch = max(max_batch, len(self.engine.scheduler.running))
        except BaseException:
            self.engine.abort_all()  # leave no request (and no page) behind for the next call
            raise
        elapsed = time.perf_counter() - t0
        out = [SampleGroup(i, [Sample(list(r.prompt_ids), list(r.output_ids), list(r.output_logprobs),
                                      r.finish_reason or "abort", r.spec.seed) for r in reqs])
               for i, reqs in enumerate(groups)]
        num_tokens = sum(len(r.output_ids) for r in requests)
        steps = self.engine.num_steps - steps0
        timeline = Timeline(phases=[{"layout": self.config.layout, "t_start": 0.0, "t_end": elapsed,
                                     "steps": steps, "batch_size": max_batch, "tokens": num_tokens}])
        lens = [len(r.output_ids) for r in requests]
        metrics = {"rollout/response_len/mean": float(np.mean(lens)), "rollout/response_len/max": float(max(lens)),
                   "perf/tokens_per_s": num_tokens / max(elapsed, 1e-9), "perf/steps": float(steps),
                   "timing_s/generate": elapsed}
        return RolloutBatch(out, timeline, metrics)

    def _make_requests(self, prompts, sampling) -> tuple[list[Request], list[list[Request]]]:
        """Validate everything, then build the requests (nothing is queued on error)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts: expected at least one prompt")
        if sampling is None:
            sampling = SamplingParams()
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        if len(params) != len(prompts):
            raise ValueError(f"sampling: expected one SamplingParams or {len(prompts)}, got {len(params)}")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling[{i}]: expected SamplingParams, got {type(p).__name__}")
        vocab = self.model_config.vocab_size
        token_lists = []
        for i, prompt in enumerate(prompts):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
            if not ids:
                raise ValueError(f"prompts[{i}]: empty prompt")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompts[{i}]: token ids {bad[:5]} outside the vocabulary [0, {vocab})")
            if len(ids) >= self.max_len:
                raise ValueError(f"prompts[{i}]: {len(ids)} tokens is longer than the context "
                                 f"(max_model_len {self.max_len} leaves no room for a response)")
            token_lists.append(ids)
        for i, p in enumerate(params):
            bad = [t for t in p.stop_token_ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"sampling[{i}].stop_token_ids: {bad} outside the vocabulary [0, {vocab})")
        call = self._num_calls
        self._num_calls += 1
        eos = tuple(self.model_config.eos_token_ids)
        requests, groups = [], []
        for i, (ids, p) in enumerate(zip(token_lists, params)):
            group = []
            for j in range(p.n):
                seed = derive_seed(p.seed, j) if p.seed is not None else derive_seed(self.config.seed, call, i, j, 1)
                spec = SamplingSpec(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                                    max_new_tokens=p.max_new_tokens, stop_token_ids=p.stop_token_ids,
                                    ignore_eos=p.ignore_eos, seed=seed)
                req = Request(self._next_request_id, list(ids), spec, self.max_len, eos)
                self._next_request_id += 1
                if not self.engine.scheduler.can_ever_admit(req):
                    raise ValueError(f"num_pages: prompts[{i}] needs {req.pages_needed(self.config.page_size)} "
                                     f"pages (prompt + max_new_tokens), the pool has {self.engine.pages.num_pages}")
                group.append(req)
                requests.append(req)
            groups.append(group)
        return requests, groups

    # ---- lifecycle -----------------------------------------------------------------------------
    def abort(self) -> int:
        """Abort everything queued or running; returns how many requests were aborted."""
        return len(self.engine.abort_all())

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load new weights in place (the full state dict, same names as the model's; strict)."""
        self.model.load_state_dict(state_dict, strict=True)

    def shutdown(self) -> None:
        if not self._closed:
            self.engine.abort_all()
            self._closed = True

    def __enter__(self) -> "RolloutEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
