"""A fleet: R engine replicas placed by Ray, one entry point, one weight push, and lost replicas that lose no request.

Why: an RL step's thousands of prompts are spread over many engines, each spanning one node's
devices (where the attention layouts switch over the fast links); the frameworks our users come
from place such engines with Ray. Here each replica is a Ray actor (``replica.Replica``) holding a
``RolloutEngine`` of T ranks, in a placement group of its own: one bundle of T ranks' resources
(``{"CPU": T * cpus_per_rank}``, and ``"GPU": T`` on GPUs), so a replica never straddles nodes.
The engine spawns its ranks inside the actor, on that node.

One entry point: ``submit`` / ``agenerate`` / ``generate`` take prompts one at a time or as a
batch; each prompt's group of ``n`` samples goes to one replica, chosen by ``placement.Placement``
(the replica that caches its prefix, unless that one is busy; else the least loaded). Each replica
runs its own layout policy on its own batch.

Seeds: a prompt without ``sampling.seed`` gets one here (from the fleet's seed and a counter) before
it is placed, so the samples depend on the seed alone -- the same on any replica, and the same
again when a lost replica's requests are resubmitted. A replica is lost when a call to it fails
because its actor died, or when it does not answer the health check within
``health_timeout_s``; it is killed, its placement group freed, and every request it held is sent to
another replica (``resubmit=True``) or ends with ``ReplicaLost`` naming it. Each request is returned
exactly once: its future is completed by the one coroutine that owns it.

Every piece of fleet state (placement, replicas, counters) is touched only by the fleet's own
asyncio loop, a thread of the calling process; the sync and async APIs hand their work to it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from splash_rollout.engine.weight_update import DEFAULT_BUCKET_BYTES
from splash_rollout.fleet.placement import Placement, PlacementOptions
from splash_rollout.rollout.group_handle import GroupHandle
from splash_rollout.rollout.config import EngineConfig
from splash_rollout.rollout.types import RolloutBatch, SampleGroup, SamplingParams, Timeline


def _ray():
    try:
        import ray
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError('splash_rollout.fleet needs Ray: pip install "splash_rollout[ray]"',
                                  name=e.name) from e
    return ray


class ReplicaLost(RuntimeError):
    """A request's replica was lost and the fleet does not resubmit (``resubmit=False``)."""


@dataclass(frozen=True)
class FleetOptions:
    """How many replicas, where, and what happens when one is lost."""

    replicas: int = 2
    """R: engines of ``EngineConfig.parallel.world_size`` ranks each."""
    ray_address: str | None = None
    """A running Ray cluster (``"auto"``, ``"ray://host:10001"``, ...); None: the cluster this process
    is already connected to, else a local one started here (and stopped with the fleet)."""
    cpus_per_rank: int = 1
    """CPUs each rank reserves (with one GPU each when the engine runs on CUDA)."""
    resubmit: bool = True
    """A lost replica's requests go to the others (same seeds: the same samples); False: they end
    with ``ReplicaLost``."""
    health_interval_s: float = 5.0
    """How often every replica is asked for its info (its liveness check)."""
    health_timeout_s: float | None = None
    """A replica that does not answer within this is lost; None: ``EngineConfig.parallel.rank_timeout_s``."""
    start_timeout_s: float = 600.0
    """A replica's placement group and engine must be ready within this."""
    seed: int | None = None
    """Seeds of prompts sampled without one; None: ``EngineConfig.model.seed``."""
    placement: PlacementOptions = field(default_factory=PlacementOptions)

    def __post_init__(self) -> None:
        for name in ("replicas", "cpus_per_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"fleet.{name}: expected an integer >= 1, got {value!r}")
        for name in ("health_interval_s", "start_timeout_s", "health_timeout_s"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"fleet.{name}: expected seconds > 0, got {value!r}")
        if isinstance(self.placement, dict):
            object.__setattr__(self, "placement", PlacementOptions(**self.placement))


class FleetRequest(GroupHandle):
    """One prompt's group in a fleet -- the handle ``RolloutEngine.submit`` returns, served by a
    replica: ``result()`` blocks, ``await`` awaits, ``stream()`` yields tokens as they come (with
    ``stream=True`` at submission; else each sample's tokens at its end), ``abort()`` /
    ``abort_sample(i)`` end samples. ``replica`` is the replica serving it (the last one tried)."""

    def __init__(self, prompt_ids: list[int], sampling: SamplingParams, streamed: bool,
                 abort: Callable[["FleetRequest", list[int]], None]) -> None:
        super().__init__(prompt_ids, sampling.n, lambda samples: abort(self, samples))
        self.sampling, self.streamed = sampling, streamed
        self.replica: int | None = None
        self.attempts = 0
        self.aborted: set[int] = set()
        """Samples the caller aborted: aborted again on a replica the request is resubmitted to."""
        self.live: tuple[Any, list[int]] | None = None
        """(actor, request ids per sample) of the replica serving it now, once that one took it."""


@dataclass
class _Member:
    actor: Any
    group: Any
    """Its placement group."""


class Fleet:
    """R replicas behind one API. ``Fleet(EngineConfig(...), FleetOptions(replicas=2))``; use as a
    context manager or call ``shutdown()``."""

    def __init__(self, config: EngineConfig, options: FleetOptions = FleetOptions()) -> None:
        ray = _ray()
        self.config, self.options = config, options
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=options.ray_address, include_dashboard=False, log_to_driver=False)
        self._health_timeout_s = options.health_timeout_s or config.parallel.rank_timeout_s
        self.placement = Placement(options.placement)
        self._members: dict[int, _Member] = {}
        self._next_index = 0
        self._seed_counter = 0
        self._pushes = 0
        self._weights: tuple[Any, int] | None = None
        """The last push (object reference, version): what a replica that joins gets first."""
        self.weight_version = 0
        self.lost: list[dict] = []
        """Each replica lost so far: index, why, when, requests resubmitted."""
        self.model_config = config.served_model()
        self.max_len = config.model.context_limit(self.model_config)
        self._tokenizer = None
        self._in_flight = 0
        """Requests submitted and not ended: counted up by ``submit`` (any thread), down on the fleet's
        loop, under ``_count_lock``."""
        self._count_lock = threading.Lock()
        self._stopping = threading.Event()
        """Set by ``stop_serving``: ``serve_here`` returns, ``submit`` refuses."""
        self._closed = False
        self._health: concurrent.futures.Future | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="splash-fleet", daemon=True)
        self._thread.start()
        try:
            self._call(self._start(options.replicas))
        except BaseException:
            self.shutdown()
            raise
        self._health = asyncio.run_coroutine_threadsafe(self._watch(), self._loop)

    # ---- the API ------------------------------------------------------------------------------------
    def submit(self, prompt, sampling: SamplingParams | None = None, stream: bool = True) -> FleetRequest:
        """One prompt (token ids or text) and its ``n`` samples, placed on a replica at once.
        ``stream``: its tokens come back as the replica's steps produce them (one message per step);
        False: each sample's tokens at its end (fewer messages: what ``generate`` and ``agenerate``
        use)."""
        if self._closed:
            raise RuntimeError("fleet: shut down")
        if self._stopping.is_set():
            raise RuntimeError("fleet: serving stopped (stop_serving)")
        request = FleetRequest(self._prompt_ids(prompt), sampling or SamplingParams(), stream, self._abort_samples)
        with self._count_lock:
            self._in_flight += 1
        asyncio.run_coroutine_threadsafe(self._seed_and_serve(request), self._loop)
        return request

    async def agenerate(self, prompt, sampling: SamplingParams | None = None) -> SampleGroup:
        return await self.submit(prompt, sampling, stream=False)

    def generate(self, prompts: Sequence[Any] | str, sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 timeout_s: float | None = None, **streaming) -> RolloutBatch:
        """Every prompt's group, in prompt order (``prompt_index`` is its position here), as
        ``RolloutEngine.generate`` returns them; ``timeline`` holds each replica's phases, switches and
        decisions of this call, each tagged with its ``replica``."""
        if streaming:
            raise ValueError(f"fleet.generate: {', '.join(sorted(streaming))} (streaming, over-sampling, partial "
                             f"rollout) run on one engine only for now")
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling: expected one SamplingParams or {len(prompts)}, got {len(params)}")
        marks = {row["replica"]: row["mark"] for row in self._call(self._gather("mark", tag=True))}
        requests = [self.submit(p, s, stream=False) for p, s in zip(prompts, params)]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        groups = []
        for i, r in enumerate(requests):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            groups.append(dataclasses.replace(r.result(left), prompt_index=i))
        merged = merge_timelines(self._call(self._timelines_since(marks)))
        served = [r.replica for r in requests]
        metrics = {"fleet/replicas": float(len(self._members)), "fleet/replicas_lost": float(len(self.lost)),
                   "fleet/resubmitted": float(sum(r.attempts - 1 for r in requests)),
                   **{f"fleet/replica_{i}/groups": float(served.count(i)) for i in sorted(set(served))}}
        return RolloutBatch(groups=groups, timeline=merged, metrics=metrics)

    def update_weights(self, named_tensors: dict, version: int | None = None,
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
        """Full weights to every replica, all or none. The tensors go into Ray's object store once, in
        buckets of at most ``bucket_bytes`` (a tensor larger goes alone); every replica fetches and
        validates the whole push first (names, shapes, exact dtypes, no NaN or infinity) and changes
        nothing; only when all have, each puts it into its engine. A push any replica refuses is
        discarded by all and raises its ValueError: the old weights keep serving everywhere. A replica
        lost during the push is taken out; the others go on. Replicas that join later get the last
        push first. Returns the version now stamped on tokens."""
        ray = _ray()
        version = self.weight_version + 1 if version is None else version
        buckets, size = [{}], 0
        for name, tensor in dict(named_tensors).items():
            t = tensor.detach().cpu()
            if buckets[-1] and size + t.nbytes > bucket_bytes:
                buckets.append({})
                size = 0
            buckets[-1][name] = t
            size += t.nbytes
        refs = [ray.put(b) for b in buckets]
        self._call(self._push(refs, version))
        self._weights, self.weight_version = (refs, version), version
        return version

    def add_replica(self) -> int:
        """Start one more replica (it gets the last weight push before it takes requests); its index."""
        return self._call(self._start(1))[0]

    def info(self) -> list[dict]:
        """Per live replica: index, pid, weight version, groups served, in flight, cached tokens."""
        return self._call(self._gather("info"))

    def timelines(self) -> dict[int, dict]:
        """Per live replica, the layout timeline of what it served (its last 4,096 steps)."""
        return dict(self._call(self._timelines_since({})))

    # ---- what the OpenAI server serves (serve/backend.py), as RolloutEngine has it -----------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from splash_rollout.models.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.config.model.tokenizer_source())
        return self._tokenizer

    @property
    def requests_in_flight(self) -> int:
        """Requests submitted and not yet ended (all replicas)."""
        return self._in_flight

    @property
    def serving_error(self) -> str | None:
        """Why the fleet can serve no more (shut down, or every replica lost), or None."""
        if self._closed:
            return "fleet: shut down"
        if not self._members:
            return f"fleet: no replica left (lost: {', '.join(str(x['replica']) + ': ' + x['why'] for x in self.lost)})"
        return None

    def abort_submitted(self) -> int:
        """Abort every request in flight on every replica (finish_reason ``abort``); returns how many."""
        return sum(self._call(self._gather("abort_submitted")))

    def serving_timeline(self) -> dict:
        """Every replica's layout timeline (its last 4,096 steps), merged, each row tagged with its replica."""
        return merge_timelines(self._call(self._timelines_since({}))).to_dict()

    def replica_states(self) -> list[dict]:
        """Per live replica, ``RolloutEngine.serving_state()`` and its ``replica``."""
        return self._call(self._gather("state"))

    def sleep(self) -> None:
        """Every replica's engine gives back its memory (``RolloutEngine.sleep``), or none does: when one
        refuses (requests in flight), those that slept wake again and its RuntimeError is raised."""
        self._call(self._all_or_none("sleep", undo="wake_up"))

    def wake_up(self) -> None:
        """Every replica's engine takes its memory back (``RolloutEngine.wake_up``)."""
        self._call(self._all_or_none("wake_up", undo=None))

    def serve_here(self, ready: Callable[[], None] | None = None) -> None:
        """Block until ``stop_serving()`` or ``shutdown()`` (the replicas serve in their own processes
        and the fleet in its loop's thread; this is for a caller that serves in its main thread, as
        ``python -m splash_rollout.serve`` does). ``ready()`` is called first."""
        if ready is not None:
            ready()
        while not self._stopping.wait(0.5):  # a timeout: a signal handler of the main thread gets to run
            if self._closed:
                return

    def stop_serving(self, timeout_s: float = 60.0) -> None:
        """Refuse new requests, abort those in flight (handed back with finish_reason ``abort``) and
        end ``serve_here``."""
        self._stopping.set()
        if not self._closed:
            self.abort_submitted()
            deadline = time.monotonic() + timeout_s
            while self._in_flight and time.monotonic() < deadline:
                time.sleep(0.05)

    def replica_actor(self, index: int):
        """The Ray actor of replica ``index`` (to inspect or kill it)."""
        return self._members[index].actor

    @property
    def replicas(self) -> list[int]:
        return sorted(self._members)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        ray = _ray()
        if self._loop.is_running():
            try:
                self._call(self._stop_all(), timeout_s=120)
            except Exception as e:  # noqa: BLE001 - shutting down: say it and go on
                warnings.warn(f"fleet shutdown: {e}", RuntimeWarning, stacklevel=2)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- the fleet's loop ---------------------------------------------------------------------------
    def _call(self, coro, timeout_s: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        ids = list(prompt)
        if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt: expected a string or a non-empty list of token ids (int)")
        return ids

    async def _seed_and_serve(self, request: FleetRequest) -> None:
        if request.sampling.seed is None:
            from splash_rollout.rollout.engine import derive_seed

            base = self.options.seed if self.options.seed is not None else self.config.model.seed
            request.sampling = dataclasses.replace(request.sampling, seed=derive_seed(base, self._seed_counter, 3))
            self._seed_counter += 1
        try:
            group = await self._serve(request)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the request
            request._fail(e)
        else:
            for i, sample in enumerate(group.samples):  # what a stream has not had yet (all, unstreamed)
                request._advance(i, 0, sample.response_ids, sample.response_logprobs, sample.weight_version,
                                 sample.finish_reason)
            request._complete(group)
        finally:
            with self._count_lock:
                self._in_flight -= 1

    async def _serve(self, request: FleetRequest) -> SampleGroup:
        """The request on a replica, then on the next one each time its replica is lost."""
        lost_errors = _lost_errors()
        n = request.sampling.n
        while True:
            if not self._members:
                raise ReplicaLost(f"fleet: no replica left to serve this request (lost: {self.lost})")
            replica = self.placement.pick(request.prompt_ids)
            request.replica, request.attempts = replica, request.attempts + 1
            self.placement.started(replica, request.prompt_ids, n)
            try:
                return await self._follow(request, self._members[replica].actor)
            except lost_errors as e:
                self._lose(replica, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
                if not self.options.resubmit:
                    raise ReplicaLost(f"replica {replica} was lost while serving this request ({e}); "
                                      f"resubmit is off") from e
            finally:
                request.live = None
                self.placement.ended(replica, n)

    async def _follow(self, request: FleetRequest, actor) -> SampleGroup:
        """One attempt: the replica's messages (``Replica.stream``) into the request's handle. Tokens go
        by their position in the sample, so an attempt after a lost replica hands out only what the
        lost one had not."""
        seen = [0] * request.n
        messages = actor.stream.options(num_returns="streaming").remote(request.prompt_ids, request.sampling,
                                                                           request.streamed)
        async for ref in messages:
            kind, payload = await ref
            if kind == "admitted":
                request.live = (actor, payload)
                request._admit()
                if request.aborted:  # aborted before (or on a replica since lost): end them here too
                    actor.abort.remote([payload[i] for i in sorted(request.aborted)])
            elif kind == "tokens":
                for i, ids, logprobs, version, reason in payload:
                    request._advance(i, seen[i], ids, logprobs, version, reason)
                    seen[i] += len(ids)
            else:
                return payload
        raise RuntimeError(f"replica {request.replica}: its stream ended before the group did")

    def _abort_samples(self, request: FleetRequest, samples: list[int]) -> None:
        """``FleetRequest.abort*`` (any thread): recorded, and sent to the replica serving it."""
        def on_loop() -> None:
            request.aborted.update(samples)
            if request.live is not None:
                actor, ids = request.live
                actor.abort.remote([ids[i] for i in samples])
        self._loop.call_soon_threadsafe(on_loop)

    def _lose(self, replica: int, why: str) -> None:
        """Take ``replica`` out: no request goes to it again, its actor and placement group go."""
        member = self._members.pop(replica, None)
        if member is None:
            return  # another request already saw it go
        ray = _ray()
        self.placement.remove(replica)
        self.lost.append({"replica": replica, "why": why, "at": time.time()})
        warnings.warn(f"fleet: replica {replica} lost ({why}); its requests "
                      f"{'go to the others' if self.options.resubmit else 'end with ReplicaLost'}",
                      RuntimeWarning, stacklevel=2)
        for undo in (lambda: ray.kill(member.actor, no_restart=True),
                     lambda: ray.util.remove_placement_group(member.group)):
            try:
                undo()
            except Exception:  # noqa: BLE001 - already gone
                pass

    async def _start(self, count: int) -> list[int]:
        """``count`` replicas, started side by side; each is in ``placement`` once its engine is built
        and holds the last weight push."""
        ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from splash_rollout.fleet.replica import Replica

        t = self.config.parallel.world_size
        gpu = self.config.parallel.device.startswith("cuda")
        bundle = {"CPU": t * self.options.cpus_per_rank, **({"GPU": t} if gpu else {})}
        started = []
        for _ in range(count):
            index, self._next_index = self._next_index, self._next_index + 1
            group = placement_group([bundle], strategy="STRICT_PACK", name=f"splash-replica-{index}-{id(self)}")
            actor = ray.remote(Replica).options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_concurrency=10_000,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
            ).remote(self.config, index)
            self._members[index] = _Member(actor, group)
            started.append(index)

        async def ready(index: int) -> None:
            member = self._members[index]
            try:
                await asyncio.wait_for(member.group.ready(), self.options.start_timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(f"fleet: replica {index} needs {bundle} on one node; the cluster had no room "
                                   f"within {self.options.start_timeout_s} s (available: "
                                   f"{ray.available_resources()})") from None
            try:
                await asyncio.wait_for(member.actor.info.remote(), self.options.start_timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(f"fleet: replica {index}'s engine was not built within "
                                   f"{self.options.start_timeout_s} s") from None
            if self._weights is not None:  # the last push, before it takes requests
                await self._push(*self._weights, members=[index])

        results = await asyncio.gather(*(ready(i) for i in started), return_exceptions=True)
        failed = [(i, r) for i, r in zip(started, results) if isinstance(r, BaseException)]
        for i, _ in failed:
            self._lose(i, "it did not start")
        if failed:
            raise RuntimeError(f"fleet: replica {failed[0][0]} did not start: {failed[0][1]}") from failed[0][1]
        for i in started:
            if i in self._members:  # not lost while it took the last push
                self.placement.add(i)
        return started

    async def _push(self, refs: list, version: int, members: list[int] | None = None) -> None:
        """Stage ``refs`` on ``members`` (default: every replica), then commit on those that staged."""
        lost_errors = _lost_errors()
        self._pushes += 1
        push = self._pushes
        chosen = [(i, self._members[i]) for i in (members if members is not None else sorted(self._members))]

        async def each(method: str, *args) -> list:
            out = await asyncio.gather(*(getattr(m.actor, method).remote(*args) for _, m in chosen),
                                       return_exceptions=True)
            for (index, _), r in zip(chosen, out):
                if isinstance(r, lost_errors):
                    self._lose(index, f"lost during a weight push: {type(r).__name__}")
            return [r for r in out if isinstance(r, BaseException) and not isinstance(r, lost_errors)]

        refused = await each("stage", push, refs)
        chosen = [(i, m) for i, m in chosen if i in self._members]
        if refused:
            await each("discard", push)
            raise refused[0]
        failed = await each("commit", push, version)
        if failed:
            raise failed[0]

    async def _timelines_since(self, marks: dict[int, int]) -> list[tuple[int, dict]]:
        members = sorted(self._members.items())
        out = await asyncio.gather(*(m.actor.timeline.remote(marks.get(i, 0)) for i, m in members),
                                   return_exceptions=True)
        return [(i, t) for (i, _), t in zip(members, out) if not isinstance(t, BaseException)]

    async def _gather(self, method: str, tag: bool = False) -> list:
        members = list(self._members.items())
        out = await asyncio.gather(*(getattr(m.actor, method).remote() for _, m in members), return_exceptions=True)
        rows = []
        for (index, _), r in zip(members, out):
            if isinstance(r, BaseException):
                continue
            rows.append(({**r} if isinstance(r, dict) else {method: r}) | {"replica": index} if tag else r)
        return rows

    async def _all_or_none(self, method: str, undo: str | None) -> None:
        """``method`` on every replica; when one refuses, ``undo`` on those that did it, then its error."""
        members = list(self._members.items())
        out = await asyncio.gather(*(getattr(m.actor, method).remote() for _, m in members), return_exceptions=True)
        failed = [(i, r) for (i, _), r in zip(members, out) if isinstance(r, BaseException)]
        if not failed:
            return
        if undo is not None:
            await asyncio.gather(*(getattr(m.actor, undo).remote() for (_, m), r in zip(members, out)
                                   if not isinstance(r, BaseException)), return_exceptions=True)
        index, error = failed[0]
        raise RuntimeError(f"{method}: replica {index}: {error}") from error

    async def _watch(self) -> None:
        """The health check: every replica answers ``info`` within the timeout, or is lost."""
        lost_errors = _lost_errors()
        while True:
            await asyncio.sleep(self.options.health_interval_s)
            for index, member in list(self._members.items()):
                try:
                    await asyncio.wait_for(member.actor.info.remote(), self._health_timeout_s)
                except asyncio.TimeoutError:
                    self._lose(index, f"no answer to the health check within {self._health_timeout_s} s")
                except lost_errors as e:
                    self._lose(index, type(e).__name__)

    async def _stop_all(self) -> None:
        ray = _ray()
        if self._health is not None:
            self._health.cancel()
        members = list(self._members.values())
        self._members.clear()
        await asyncio.gather(*(asyncio.wait_for(m.actor.shutdown.remote(), 60) for m in members),
                             return_exceptions=True)
        for m in members:
            for undo in (lambda: ray.kill(m.actor, no_restart=True), lambda: ray.util.remove_placement_group(m.group)):
                try:
                    undo()
                except Exception:  # noqa: BLE001 - already gone
                    pass


def merge_timelines(timelines: list[tuple[int, dict]]) -> Timeline:
    """Replicas' timelines (``(replica, Timeline.to_dict())``, rows tagged with their replica) as one."""
    return Timeline(**{key: [row for _, t in timelines for row in t.get(key, [])]
                       for key in ("phases", "switches", "decisions", "speculation")})


def _lost_errors() -> tuple[type[BaseException], ...]:
    """The errors that mean a replica is gone (not that its request was bad)."""
    ex = _ray().exceptions
    return tuple(getattr(ex, name) for name in ("RayActorError", "ActorDiedError", "ActorUnavailableError")
                 if hasattr(ex, name))
