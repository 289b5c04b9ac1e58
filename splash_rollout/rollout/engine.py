"""RolloutEngine: the public face -- prompts and SamplingParams in, a RolloutBatch out.

Builds the model on every rank (preset: random init seeded by ``EngineConfig.model.seed``; folder: HF
checkpoint) and the engine under it, and turns each (prompt, sample j) into an engine Request with
its own seed. All inputs are validated before any work starts. Where the ranks live -- this
process (one rank, or the caller's torchrun ranks) or ranks the engine spawns -- is the host's
business (``rollout/ranks.py``); every method here has one code path.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch

from splash_rollout.engine.request import Request, SamplingSpec
from splash_rollout.engine.weight_update import DEFAULT_BUCKET_BYTES, served_part, validate_update
from splash_rollout.models.config import ModelConfig, resolve_model
from splash_rollout.models.numerics import numerics_mode, set_numerics
from splash_rollout.rollout.config import EngineConfig
from splash_rollout.rollout.ranks import (LocalHost, RequestRecord, SpawnedHost, worker_build, worker_can_ever_admit,
                                          worker_memory_stats, worker_request_switch, worker_sleep, worker_wake_up)
from splash_rollout.rollout.progress import progress_enabled
from splash_rollout.rollout.call_modes import LoopCall, StreamingCall, WholeCall, call_mode
from splash_rollout.rollout.call_timeline import build_timeline, layout_metrics, memory_metrics, speculation_metrics
from splash_rollout.rollout.validation import (check_queue_bound, check_sampling, check_world_size,
                                               prompt_ids, request_digest)
from splash_rollout.rollout.types import RolloutBatch, Sample, SampleGroup, SamplingParams


def derive_seed(*keys: int) -> int:
    """A well-mixed 63-bit seed from integer keys (distinct keys give distinct seeds w.h.p.)."""
    state = np.random.SeedSequence([int(k) & (2**64 - 1) for k in keys]).generate_state(2, np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1]))


class RolloutEngine:
    """Prompts in, groups of samples out. ``world_size`` 1 runs in this process; more ranks are
    spawned here, or, when torch.distributed is already initialised with ``world_size`` ranks
    (torchrun, a trainer), hosted by the caller's ranks — then every rank calls ``generate`` with
    the same prompts and every rank gets the whole batch."""

    def __init__(self, config: EngineConfig) -> None:
        from splash_rollout.distributed.groups import ProcessGroups, groups_in_process, initialized_world_size
        from splash_rollout.rollout.process_settings import apply_cpu_process_settings

        self.config = config
        apply_cpu_process_settings(config.compute, config.parallel.device)
        self._compute_threads = torch.get_num_threads()
        # process-wide while the engine lives: a trainer in this process computes like the engine
        self._numerics_before = numerics_mode()
        set_numerics(config.compute.numerics)
        self.model_config: ModelConfig = config.served_model()
        self.max_len = config.model.context_limit(self.model_config)
        t = config.parallel.world_size
        check_world_size(self.model_config, t)
        existing = initialized_world_size()
        if t > 1 and existing not in (None, 1, t):
            raise ValueError(f"world_size: {t}, but this process group has {existing} ranks")
        self._abort = threading.Event()  # abort(): checked by the driver at each step boundary
        self._call_lock = threading.Lock()
        self._ranks_lock = threading.RLock()
        """Held by whatever talks to the ranks (a generate call, a serving-loop poll, a weight push):
        one at a time."""
        self._loop = None
        """The serving loop (rollout/serving_loop.py), started by the first ``submit``."""
        self._in_call: list[Request] | None = None  # the requests of the running generate call
        self._broken: str | None = None  # why the engine became unusable (a rank failed)
        self._closed = False
        if t == 1:
            self._host = LocalHost(ProcessGroups.single(config.parallel.rank_timeout_s))
        elif existing == t:  # torchrun / a trainer's group: the engine lives in the caller's ranks
            self._host = LocalHost(groups_in_process(config.parallel.rank_timeout_s))
        else:  # a plain process (or a one-rank trainer group): spawn the T ranks
            self._host = SpawnedHost(t, config.parallel.rank_timeout_s, config.parallel.device)
        try:
            built = self._on_ranks(worker_build, config)
            self._host.after_build()
        except BaseException:
            self._host.shutdown(force=True)
            raise
        self._full_shapes = built["full_shapes"]
        self._tokenizer = None
        self.weight_version = 0
        """Stamped on every sample; set by ``update_weights(..., version)``."""
        self._num_calls = 0
        self._next_request_id = 0
        self._asleep = False
        self._progress = progress_enabled(config.outputs.progress)
        """Whether the driver draws a progress bar (EngineConfig.outputs.progress, resolved here)."""

    @property
    def rank(self) -> int:
        return self._host.rank

    @property
    def local_engine(self):
        """This process's ``engine.Engine`` (world_size 1, or this rank under torchrun); None when the
        ranks are spawned. For inspection (page managers, pools, logs), not for driving calls."""
        return self._host.local_engine

    @property
    def model(self):
        """The model in this process at world_size 1 (the engine computes with its weights; a trainer
        may score with it); None with more ranks, where each rank holds only its shards."""
        engine = self.local_engine
        return engine.model if engine is not None and self.config.parallel.world_size == 1 else None

    @property
    def worker_group(self):
        """The spawned ranks (``distributed.launch.WorkerGroup``), or None when the engine lives in
        this process. ``worker_group.run(fn)`` runs a module-level ``fn(ctx)`` on every rank."""
        return self._host.worker_group

    # ---- tokenizer -----------------------------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from splash_rollout.models.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.config.model.tokenizer_source())
        return self._tokenizer

    # ---- generate ------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Any] | str,
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 on_group: Callable[[SampleGroup], bool] | None = None, target_groups: int | None = None,
                 poll_steps: int = 1, resume: Sequence[SampleGroup] | None = None) -> RolloutBatch:
        """One group of ``n`` samples per prompt (token-id list or string).

        Streaming (``rollout/streaming.py``), when ``on_group`` or ``target_groups`` is given: every
        ``poll_steps`` engine steps, each group whose samples have all finished goes to
        ``on_group(group) -> bool`` (True keeps it; default: keep every group) in the order groups
        complete; once ``target_groups`` groups are kept the rest of the call is aborted at the next
        step boundary. ``batch.groups`` then holds the kept groups (completion order),
        ``batch.filtered`` the rejected ones and ``batch.aborted`` the unused rest, which together
        are every prompt of the call. No progress bar while streaming.

        ``resume``: groups of an earlier call to finish in this one (e.g. its ``batch.aborted``), ahead
        of the prompts, in one engine call: a group's finished samples are kept as they are and its
        aborted ones continue under the current weights as ``resume()`` continues them (same seed and
        draw counter, per-token ``token_versions``; they are queued before the prompts' samples).
        These groups are the call's first ones (``prompt_index`` 0 .. len(resume) - 1, the prompts
        follow), so a streaming call judges a resumed group like any other; ``prompts`` may then be
        empty. Every rank (torchrun) passes the same groups."""
        self._check_usable("generate")
        self._check_awake("generate")
        carried = self._check_carried(resume)
        no_prompts = isinstance(prompts, (list, tuple)) and not prompts and bool(carried)
        mode = call_mode(on_group, target_groups, poll_steps)
        count = 1 if isinstance(prompts, str) else len(prompts) if hasattr(prompts, "__len__") else None
        mode.check(None if count is None else count + len(carried))
        counters = (self._num_calls, self._next_request_id)
        fresh, fresh_groups = ([], []) if no_prompts else self._make_requests(prompts, sampling)
        try:
            requests, groups, earlier, slots = self._resume_requests(carried)
        except BaseException:
            self._num_calls, self._next_request_id = counters
            raise
        offset = len(groups)
        slots.update({offset + i: [None] * len(g) for i, g in enumerate(fresh_groups)})
        if isinstance(mode, WholeCall) and self._loop is not None and self._loop.error is None:
            mode = LoopCall()  # the engine serves submitted requests: the call joins what runs
        return self._serve_call(requests + fresh, groups + fresh_groups, mode, earlier, slots if carried else None)

    def _check_resumable(self, where: str, s: Sample) -> None:
        """A sample ``resume`` can continue (its finish reason is the caller's check)."""
        if s.spec is None:
            raise ValueError(f"{where}: carries no sampling settings (spec); resume takes samples "
                             f"this engine returned")
        if len(s.response_ids) >= s.spec.max_new_tokens:
            raise ValueError(f"{where}: already has max_new_tokens={s.spec.max_new_tokens} tokens")
        if len(s.prompt_ids) + len(s.response_ids) >= self.max_len:
            raise ValueError(f"{where}: prompt + response ({len(s.prompt_ids) + len(s.response_ids)} tokens) "
                             f"already reach max_model_len {self.max_len}")

    def _check_carried(self, resume) -> list[SampleGroup]:
        """``generate(resume=...)``: a list of SampleGroups whose aborted samples can continue."""
        if resume is None:
            return []
        if isinstance(resume, SampleGroup) or not isinstance(resume, (list, tuple)):
            raise TypeError(f"resume: expected a list of SampleGroups (e.g. an earlier batch.aborted), "
                            f"got {type(resume).__name__}")
        for i, g in enumerate(resume):
            if not isinstance(g, SampleGroup) or not g.samples:
                raise TypeError(f"resume[{i}]: expected a SampleGroup with samples, got {g!r:.80}")
            for j, s in enumerate(g.samples):
                if not isinstance(s, Sample):
                    raise TypeError(f"resume[{i}].samples[{j}]: expected a Sample, got {type(s).__name__}")
                if s.finish_reason == "abort":
                    self._check_resumable(f"resume[{i}].samples[{j}]", s)
        return list(resume)

    def _resume_requests(self, carried: list[SampleGroup]):
        """Requests for the aborted samples of ``carried`` -> (requests, groups of requests, request id
        -> versions of the tokens each brings, group index -> its samples with None where a request
        fills in)."""
        eos = tuple(self.model_config.eos_token_ids)
        requests, groups, earlier, slots = [], [], {}, {}
        for gi, g in enumerate(carried):
            group, slots[gi] = [], []
            for s in g.samples:
                if s.finish_reason != "abort":
                    slots[gi].append(s)
                    continue
                req = Request(self._next_request_id, list(s.prompt_ids), s.spec, self.max_len, eos,
                              list(s.response_ids), list(s.response_logprobs))
                self._next_request_id += 1
                earlier[req.request_id] = s.versions
                group.append(req)
                slots[gi].append(None)
            requests.extend(group)
            groups.append(group)
        if requests:
            self._check_admissible(requests, groups)
        return requests, groups, earlier, slots

    def resume(self, samples: Sequence[Sample], max_off_policy_steps: int | None = None) -> RolloutBatch:
        """Continue partial samples (finish_reason ``abort``, e.g. cut off by ``abort()`` or a streaming
        call's target) under the current weights: each is prefilled with its prompt and the tokens it
        has, then samples on with its own seed and draw counter, so the tokens it adds are the ones an
        uninterrupted sample with that seed and history draws from these weights. ``token_versions``
        records each token's weight version. With ``max_off_policy_steps=k`` a sample whose oldest
        token is more than k versions old is not continued: it comes back in ``batch.dropped``.
        ``batch.groups`` holds one group per continued sample (``prompt_index`` = its index here).
        Every rank (torchrun) passes the same samples."""
        self._check_usable("resume")
        self._check_awake("resume")
        if max_off_policy_steps is not None and (isinstance(max_off_policy_steps, bool)
                                                 or not isinstance(max_off_policy_steps, int) or max_off_policy_steps < 0):
            raise ValueError(f"max_off_policy_steps: expected an integer >= 0 or None, got {max_off_policy_steps!r}")
        samples = list(samples)
        for i, s in enumerate(samples):
            if not isinstance(s, Sample):
                raise TypeError(f"samples[{i}]: expected a Sample, got {type(s).__name__}")
            if s.finish_reason != "abort":
                raise ValueError(f"samples[{i}]: finish_reason {s.finish_reason!r}; only aborted samples resume")
            self._check_resumable(f"samples[{i}]", s)
        kept, dropped = [], []
        for s in samples:
            too_old = max_off_policy_steps is not None and s.lag(self.weight_version) > max_off_policy_steps
            (dropped if too_old else kept).append(s)
        if not kept:
            return RolloutBatch([], metrics={"rollout/stale_dropped": float(len(dropped))}, dropped=dropped)
        # the one way samples continue: generate(resume=...), one group per continued sample (its
        # metrics count them under rollout/resumed_samples)
        batch = self.generate([], resume=[SampleGroup(i, [s]) for i, s in enumerate(kept)])
        batch.dropped = dropped
        batch.metrics["rollout/stale_dropped"] = float(len(dropped))
        return batch

    def continue_samples(self, samples: Sequence[Sample], appended: Sequence[Sequence[int]],
                         sampling: SamplingParams | Sequence[SamplingParams] | None = None) -> RolloutBatch:
        """Multi-turn: sample i's history (its prompt and response) plus ``appended[i]`` (a tool or
        environment reply, token ids) is the context of its next turn, and ``sampling`` (as in
        ``generate``; ``n`` continuations each) samples that turn. Each returned sample keeps the
        first turn's prompt and carries the whole trajectory as its response: earlier turns, the
        appended tokens (``loss_mask`` 0, logprob 0.0) and the new turn (``loss_mask`` 1), so a trainer
        sees one sequence with the environment's tokens masked out. Group i holds sample i's
        continuations. The earlier turns are prefilled again (their KV is reused only while another
        sample of the same context is live in the engine)."""
        samples, appended = list(samples), [list(a) for a in appended]
        if len(appended) != len(samples):
            raise ValueError(f"appended: expected one token list per sample ({len(samples)}), got {len(appended)}")
        for i, s in enumerate(samples):
            if not isinstance(s, Sample):
                raise TypeError(f"samples[{i}]: expected a Sample, got {type(s).__name__}")
            if s.finish_reason == "error":
                raise ValueError(f"samples[{i}]: finish_reason 'error' (its logits were not finite); not continued")
        contexts = [list(s.prompt_ids) + list(s.response_ids) + a for s, a in zip(samples, appended)]
        batch = self.generate(contexts, sampling)
        for g, s, a in zip(batch.groups, samples, appended):
            before = s.token_versions if s.token_versions is not None else [s.weight_version] * len(s.response_ids)
            for k, new in enumerate(g.samples):
                g.samples[k] = dataclasses.replace(
                    new, prompt_ids=list(s.prompt_ids), response_ids=list(s.response_ids) + a + new.response_ids,
                    response_logprobs=list(s.response_logprobs) + [0.0] * len(a) + new.response_logprobs,
                    response_mask=s.loss_mask + [0] * len(a) + [1] * len(new.response_ids),
                    token_versions=list(before) + [self.weight_version] * (len(a) + len(new.response_ids)),
                    routing=None)
        return batch

    def _serve_call(self, requests: list[Request], groups: list[list[Request]], mode: WholeCall | StreamingCall,
                    earlier_versions: dict[int, list[int]] | None = None,
                    slots: dict[int, list[Sample | None]] | None = None) -> RolloutBatch:
        """Serve one call's requests on every rank (``mode``: whole or streamed) and assemble its batch,
        timeline and metrics. ``slots``: group index -> its samples, finished ones given and None
        where a request fills in (groups resumed by ``generate(resume=...)``); None: every sample
        comes from a request."""
        t0 = time.perf_counter()
        with self._call_lock:
            self._in_call = requests
        try:
            served = mode.serve(self, requests, groups, earlier_versions, slots)
        finally:
            with self._call_lock:  # an abort() that arrives after the last step is not kept for the next call
                self._in_call = None
                self._abort.clear()
                self._host.clear_interrupt()
        elapsed = time.perf_counter() - t0
        results, steps = served.results, served.steps
        by_id = {r.request_id: r for r in results}
        timeline = build_timeline(steps, served.switches, served.decisions)
        lens = [len(by_id[r.request_id].output_ids) for r in requests] or [0]
        num_tokens = sum(lens)
        control = [s.control_bytes for s in steps] or [0]
        metrics = {"rollout/response_len/mean": float(np.mean(lens)), "rollout/response_len/max": float(max(lens)),
                   "perf/tokens_per_s": num_tokens / max(elapsed, 1e-9), "perf/steps": float(len(steps)),
                   "perf/max_running": float(max((s.running for s in steps), default=0)),
                   "perf/control_bytes_max": float(max(control)), "perf/control_bytes_mean": float(np.mean(control)),
                   "timing_s/generate": elapsed,
                   "rollout/aborted_samples": float(sum(r.finish_reason == "abort" for r in results)),
                   "timing_s/policy": float(sum(s.split_s.get("policy", 0.0) for s in steps))}
        if earlier_versions:
            metrics["rollout/resumed_samples"] = float(len(earlier_versions))
        metrics.update(served.metrics)
        metrics.update(layout_metrics(timeline))
        metrics.update(memory_metrics(steps))
        metrics.update(speculation_metrics(steps))
        return RolloutBatch(served.groups, timeline, metrics, filtered=served.filtered, aborted=served.aborted)

    def switch_layout(self, dst: str, blocking: bool = False) -> None:
        """Switch the attention layout at the next step boundary (the next ``generate`` call's first
        step if none is running). ``blocking`` moves all state before the step (the baseline)."""
        from splash_rollout.layout.layouts import Layout

        self._check_usable("switch_layout")
        Layout.parse(dst, "dst")
        if self.config.parallel.world_size == 1:
            raise ValueError("switch_layout: a single rank has no layouts to switch between (world_size=1)")
        self._on_ranks(worker_request_switch, dst, blocking)

    def _can_ever_admit(self, requests: list[Request]) -> list[bool]:
        return self._on_ranks(worker_can_ever_admit, [RequestRecord.of(r) for r in requests])

    def _make_requests(self, prompts, sampling, check_admission: bool = True
                       ) -> tuple[list[Request], list[list[Request]]]:
        """Validate everything, then build the requests. On error nothing is queued and the seed
        counters do not move, so the next call samples exactly as if the bad one never happened.
        ``check_admission=False``: whether each fits an empty pool is left to the ranks (``submit``:
        its serving loop's next poll refuses what can never run, without a round trip of its own)."""
        counters = (self._num_calls, self._next_request_id)
        try:
            try:
                requests, groups = self._build_requests(prompts, sampling)
                error = None
            except Exception as e:  # noqa: BLE001 - under torchrun the other ranks must hear of it
                if not self._host.every_rank_calls:
                    raise
                requests, groups, error = [], [], e
            if self._host.every_rank_calls:  # torchrun: every rank must hold the same requests
                digest = None if error else request_digest([RequestRecord.of(r) for r in requests])
                try:
                    self._host.agree(digest, error)
                except (ValueError, TypeError):
                    raise
                except BaseException as e:
                    if e is not error:
                        self._fail("generate", e)
                    raise
            if check_admission:
                self._check_admissible(requests, groups)
        except BaseException:
            self._num_calls, self._next_request_id = counters
            raise
        return requests, groups

    def _build_requests(self, prompts, sampling) -> tuple[list[Request], list[list[Request]]]:
        """Check this rank's inputs (rollout/validation.py) and turn them into Requests."""
        if isinstance(prompts, str):
            prompts = [prompts]
        try:
            prompts = list(prompts)
        except TypeError:
            raise TypeError(f"prompts: expected a string or a sequence of prompts, got {type(prompts).__name__}") \
                from None
        if not prompts:
            raise ValueError("prompts: expected at least one prompt, got none")
        if sampling is None:
            sampling = SamplingParams()
        if not isinstance(sampling, SamplingParams) and not isinstance(sampling, (list, tuple)):
            raise TypeError(f"sampling: expected SamplingParams or a list of them, got {type(sampling).__name__}")
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        if len(params) != len(prompts):
            raise ValueError(f"sampling: expected one SamplingParams or {len(prompts)}, got {len(params)}")
        vocab = self.model_config.vocab_size
        check_sampling(params, vocab, SamplingParams)
        check_queue_bound(params, self.config.batching.max_queued_requests)
        token_lists = [prompt_ids(i, prompt, vocab, self.max_len, lambda text: self.tokenizer.encode(text))
                       for i, prompt in enumerate(prompts)]
        call = self._num_calls
        self._num_calls += 1
        eos = tuple(self.model_config.eos_token_ids)
        requests, groups = [], []
        for i, (ids, p) in enumerate(zip(token_lists, params)):
            group = []
            for j in range(p.n):
                seed = (derive_seed(p.seed, j) if p.seed is not None
                        else derive_seed(self.config.model.seed, call, i, j, 1))
                spec = SamplingSpec(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                                    max_new_tokens=p.max_new_tokens, stop_token_ids=p.stop_token_ids,
                                    ignore_eos=p.ignore_eos, seed=seed)
                req = Request(self._next_request_id, list(ids), spec, self.max_len, eos)
                self._next_request_id += 1
                group.append(req)
                requests.append(req)
            groups.append(group)
        return requests, groups

    def _check_admissible(self, requests: list[Request], groups: list[list[Request]]) -> None:
        """Every request must fit one rank's empty pools in the current layout (else it never runs)."""
        for req, ok in zip(requests, self._can_ever_admit(requests)):
            if not ok:
                i = next(k for k, g in enumerate(groups) if req in g)
                raise ValueError(f"prompts[{i}]: needs {req.pages_needed(self.config.memory.page_size)} KV pages "
                                 f"(prompt + max_new_tokens), more than one rank's pool holds in layout "
                                 f"{self.config.parallel.layout}; lower max_new_tokens or raise "
                                 f"memory.memory_budget_gib / memory.num_pages")

    # ---- lifecycle -----------------------------------------------------------------------------
    def abort(self) -> int:
        """Stop the running ``generate`` call (call this from another thread) at its next step
        boundary: its unfinished requests come back with finish_reason ``abort`` (with what they had
        generated; their pages are freed), finished ones keep theirs, and ``generate`` returns
        normally. Every world size: one rank checks a flag in its step loop; spawned ranks share an
        event with this process; under torchrun call it on rank 0, whose driver polls it. Returns the
        number of requests in the running call (0 when none runs: nothing is kept for a later call)."""
        with self._call_lock:
            if self._in_call is None:
                return 0
            self._abort.set()
            self._host.interrupt()
            if self._loop is not None:  # a call served through the loop: its requests end there
                self._loop.abort([r.request_id for r in self._in_call])
            return len(self._in_call)

    def _check_usable(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what}: the engine is shut down")
        if self._broken is not None:
            raise RuntimeError(f"{what}: this RolloutEngine is unusable after a failure on its ranks ({self._broken}); "
                               f"call shutdown() and build a new RolloutEngine")

    def _on_ranks(self, fn, *args):
        """``fn`` on every rank, returning rank 0's result. A failure there leaves the ranks out of step
        (some may still sit in a collective, a switch may be half-moved), so the engine stops its
        ranks and every later call says why (an input error never gets this far: it is raised before
        anything is sent). A single rank stays usable: nothing can be out of step."""
        return self._guarded(fn.__name__, lambda: self._host.run(fn, *args))

    def _guarded(self, what: str, work: Callable[[], Any]) -> Any:
        """``work()``, which talks to the ranks (alone: the serving loop's polls and the calls take
        turns); a failure on more than one rank breaks the engine (see ``_on_ranks``)."""
        with self._ranks_lock:
            try:
                return work()
            except BaseException as e:
                if self.config.parallel.world_size > 1:
                    self._fail(what, e)
                raise

    # ---- requests that arrive while others run (rollout/serving_loop.py) ---------------------------
    def submit(self, prompt, sampling: SamplingParams | None = None):
        """One prompt (token ids or text) and its ``n`` samples, served beside whatever runs: it joins
        the running batch at the next step boundary. Returns a ``RequestHandle`` at once --
        ``handle.result()`` blocks for the ``SampleGroup``, ``await handle`` awaits it, ``async for
        delta in handle.stream()`` yields the tokens as they come, ``handle.abort()`` ends it. The samples
        are those ``generate`` gives for the same seeds (with ``sampling.seed`` unset, a seed derived
        from the engine's seed and a per-submission counter). Many threads or coroutines may submit at
        once. Not under torchrun (every rank would have to submit the same requests at the same step)."""
        from splash_rollout.rollout.serving_loop import RequestHandle, sample_group

        self._check_usable("submit")
        self._check_awake("submit")
        if self._host.every_rank_calls:
            raise RuntimeError("submit: requests that arrive one by one need ranks this engine owns (world_size 1 "
                               "or spawned); under torchrun use generate, which every rank calls")
        with self._call_lock:  # the request ids and seed counters are this process's
            requests, groups = self._make_requests([prompt], sampling, check_admission=False)
        loop = self._serving_loop()
        handle = RequestHandle(loop, requests, lambda results, versions, v: sample_group(0, requests, results,
                                                                                           versions, v))
        return loop.submit(requests, handle)

    def abort_requests(self, request_ids) -> int:
        """End submitted requests by id (``handle.request_ids``: one per sample) at the next step
        boundary, finish_reason ``abort``, their tokens so far kept; the others run on. Returns how
        many were still in flight."""
        return self._loop.abort(list(request_ids)) if self._loop is not None else 0

    async def agenerate(self, prompt, sampling: SamplingParams | None = None) -> SampleGroup:
        """``submit`` awaited: the prompt's group of ``n`` samples."""
        return await self.submit(prompt, sampling)

    def _serving_loop(self, own_thread: bool = True):
        from splash_rollout.rollout.serving_loop import ServingLoop

        with self._call_lock:
            if self._loop is not None and self._loop.error is not None:
                raise RuntimeError(f"submit: the serving loop stopped: {self._loop.error}")
            if self._loop is None:
                self._loop = ServingLoop(self, self.config.batching.poll_steps, own_thread)
            elif not own_thread:
                raise RuntimeError("serve_here: the serving loop already runs (a submit came first)")
            return self._loop

    def serve_here(self, ready: Callable[[], None] | None = None) -> None:
        """Serve submitted requests in the calling thread until ``shutdown()`` or ``stop_serving()``
        (from another thread or a signal handler), instead of in a thread of the engine's own; call it
        before the first ``submit``. ``ready()`` is called once the loop accepts requests.

        Why a caller would: with one rank in this process, the engine computes in whichever thread
        serves, and a second thread computing with torch's OpenMP pool measures 10-17 % slower than
        the thread that built the engine (2-core CPU, GNU OpenMP; see docs/serving.md). The server
        (``python -m splash_rollout.serve``) serves in its main thread and answers HTTP in another."""
        loop = self._serving_loop(own_thread=False)
        if ready is not None:
            ready()
        loop.run()

    def stop_serving(self, timeout_s: float = 60.0) -> None:
        """End the serving loop: what is in flight is aborted (finish_reason ``abort``) and handed back."""
        if self._loop is not None and self._loop.error is None:
            self._loop.stop(timeout_s)

    def _enter_compute_thread(self) -> None:
        """Called by a thread that will run this process's rank (the serving loop): the per-thread CPU
        state the engine's own thread got at construction -- the MXCSR denormal flags
        (``torch.set_flush_denormal`` sets them for the calling thread only) and torch's thread count."""
        from splash_rollout.rollout.process_settings import apply_cpu_process_settings

        apply_cpu_process_settings(self.config.compute, self.config.parallel.device)
        torch.set_num_threads(self._compute_threads)

    def _poll_ranks(self, records, abort_ids, max_steps: int):
        """One serving-loop poll on every rank (rollout/ranks.py worker_serve_async), and the weight
        version it ran under."""
        from splash_rollout.rollout.ranks import worker_serve_async

        with self._ranks_lock:
            version = self.weight_version
            return self._on_ranks(worker_serve_async, records, abort_ids, max_steps), version

    @property
    def requests_in_flight(self) -> int:
        """Requests submitted (or of a generate call served through the loop) and not yet ended."""
        return self._loop.in_flight if self._loop is not None else 0

    @property
    def serving_error(self) -> str | None:
        """Why this engine can serve no more (a failure on its ranks, or its serving loop's), or None."""
        if self._broken is not None:
            return self._broken
        error = self._loop.error if self._loop is not None else None
        return None if error is None else f"{type(error).__name__}: {error}"

    def abort_submitted(self) -> int:
        """Abort every submitted request in flight (each ends with finish_reason ``abort``, its tokens so
        far kept) at the next step boundary; returns how many."""
        return self._loop.abort_all() if self._loop is not None else 0

    def serving_timeline(self, since: int | None = None) -> dict:
        """The layout timeline (``Timeline.to_dict()``) of the steps the serving loop ran -- its last
        4,096 -- or of those after ``since`` (a ``serving_state()["total_steps"]`` read earlier)."""
        from splash_rollout.rollout.serving_loop import LoopLog

        return (self._loop.log if self._loop is not None else LoopLog()).timeline(since)

    def serving_state(self) -> dict[str, Any]:
        """What the serving loop saw after its last poll and has counted since it started: requests
        running, waiting and in flight; KV pages used, cached and in all per rank; the layout; the
        tokens per second over its last 64 steps (``serving_loop.RATE_STEPS``); the weight version; steps, switches,
        prompt rows computed, prompt tokens taken from the prefix cache, tokens written and tokens
        handed to finished requests since it started."""
        from splash_rollout.rollout.serving_loop import RATE_STEPS, TOTALS, LoopLog

        loop = self._loop
        log = loop.log if loop is not None else LoopLog()
        recent = log.steps[-RATE_STEPS:]
        seconds = sum(s.seconds for s in recent)
        return {"running": log.state.get("running", 0), "waiting": log.state.get("waiting", 0),
                "in_flight": loop.in_flight if loop is not None else 0,
                **{f"pages_{what}": list(log.state.get(f"pages_{what}", [])) for what in ("used", "cached", "total")},
                "layout": log.state.get("layout", self.config.parallel.layout),
                "tokens_per_second": sum(s.tokens_written for s in recent) / seconds if seconds > 0 else 0.0,
                "weight_version": self.weight_version, "total_steps": log.total_steps,
                **{key: log.totals.get(key, 0) for key in TOTALS},
                "tokens_out": loop.tokens_out if loop is not None else 0}

    def replica_states(self) -> list[dict[str, Any]]:
        """``[serving_state()]`` tagged ``replica`` 0: to the server, one engine is a fleet of one."""
        return [self.serving_state() | {"replica": 0}]

    def _fail(self, what: str, e: BaseException) -> None:
        lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
        cause = next((line for line in reversed(lines) if "Error" in line.split(":")[0] or "Fault" in line.split(":")[0]),
                     None)
        self._broken = f"{what}: {type(e).__name__}: {lines[0] if lines else ''}" + (
            f" ... {cause}" if cause and cause != lines[0] else "")
        self._host.after_failure()

    # ---- sleep / wake ----------------------------------------------------------------------------
    @property
    def is_sleeping(self) -> bool:
        return self._asleep

    def _check_awake(self, what: str) -> None:
        if self._asleep:
            raise RuntimeError(f"{what}: the engine is asleep (its weights and KV memory are released); "
                               f"call wake_up() first")

    def sleep(self) -> None:
        """Give back the engine's memory on every rank until ``wake_up`` (engine/sleep.py): the KV
        pool's tensors are freed (its contents are dropped) and every weight tensor's storage is
        moved out — to (pinned) host memory from an accelerator, to an unnamed temporary file from
        CPU memory — and freed in place. Refused while a ``generate`` call is running (``abort()``
        it and let it return first): nothing is aborted implicitly. Under torchrun every rank calls
        it. While asleep, ``generate`` and ``update_weights`` raise."""
        self._check_usable("sleep")
        if self._asleep:
            raise RuntimeError("sleep: the engine is already asleep")
        with self._call_lock:
            if self._in_call is not None:
                raise RuntimeError("sleep: a generate call is running; abort() it and let it return first")
        if self.requests_in_flight:
            raise RuntimeError(f"sleep: {self.requests_in_flight} submitted requests are in flight; let them end or "
                               f"abort them (handle.abort(), abort_requests) first")
        self._on_ranks(worker_sleep)
        self._asleep = True

    def wake_up(self) -> None:
        """Restore what ``sleep`` released: the weights bit for bit and an empty KV pool of the same
        size. Outputs after waking equal those before sleeping (same seeds, same tokens)."""
        self._check_usable("wake_up")
        if not self._asleep:
            raise RuntimeError("wake_up: the engine is not asleep")
        self._on_ranks(worker_wake_up)
        self._asleep = False

    def memory_stats(self) -> list[dict[str, int | None]]:
        """Per rank, measured: ``tracked_bytes`` (switchable projections + KV pool), ``kv_pool``,
        ``weights`` (allocated storage under every weight tensor), ``rss`` (the rank's process
        resident set, bytes). Under torchrun a collective: every rank calls it and gets the list."""
        return self._on_ranks(worker_memory_stats)

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int | None = None,
                       check_finite: bool = True, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        """Put full (trainer-side) weights into the engine's current layout, named as the model's
        parameters. Each rank gets only its own parts: ranks in this process (or the caller's torchrun
        ranks) cut them from the tensors they were given; spawned ranks receive theirs from here, cut
        for each rank's current layout, in buckets of at most ``bucket_bytes`` per rank. A bad push
        (unknown name, a shard or placeholder instead of the full parameter, shape, a dtype that does
        not cast exactly, and with ``check_finite`` a NaN or infinity, naming the first such tensor and
        its count) is rejected as a whole before any weight changes, and the old weights keep
        serving. ``check_finite`` reads the push once (one sum per tensor), here in the calling
        process: less than the copy the update makes (30-300 ms per 100 MB on a loaded 2-core CPU,
        ~400 ms for one copy). ``version`` is stamped on later samples. Tensors of the model's MTP
        modules (``model.mtp_layers.*``, which a trainer's state dict carries) are left out: the
        engine does not hold them (``EngineConfig.served_model``)."""
        self._check_usable("update_weights")
        self._check_awake("update_weights")
        named_tensors = served_part(named_tensors, self._full_shapes)
        validate_update(named_tensors, self._full_shapes, check_finite)  # here, before anything is sent
        self._guarded("update_weights", lambda: self._host.push_weights(dict(named_tensors), bucket_bytes))
        if version is not None:
            self.weight_version = version

    def shutdown(self) -> None:
        if not self._closed:
            if self._loop is not None and self._loop.error is None and self._broken is None:
                self._loop.stop()  # what is in flight ends with finish_reason "abort"
            self._host.shutdown()
            set_numerics(self._numerics_before)
            self._closed = True

    def __enter__(self) -> "RolloutEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
