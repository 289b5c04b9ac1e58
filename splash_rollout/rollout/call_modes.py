"""How one generate call is served and its groups handed back: whole, or streamed group by group.

``RolloutEngine`` runs every call the same way -- build the requests, serve them on the ranks,
assemble the batch, its timeline and metrics. What a plain call and a streaming one
(``on_group`` / ``target_groups``, rollout/streaming.py) do differently is only how they are
served and which groups come back where; each is a strategy here, chosen once per call.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from splash_rollout.engine.request import Request
from splash_rollout.rollout.ranks import RequestRecord, RequestResult, worker_serve
from splash_rollout.rollout.streaming import ABORTED, FILTERED, KEPT, check_stream_args, make_group, serve_streaming
from splash_rollout.rollout.types import Sample, SampleGroup


@dataclass
class Served:
    """A served call: rank 0's results and logs, and its groups as the call returns them."""

    results: list[RequestResult]
    steps: list[dict[str, Any]]
    switches: list[dict[str, Any]]
    decisions: list[dict[str, Any]]
    groups: list[SampleGroup]
    filtered: list[SampleGroup] = field(default_factory=list)
    aborted: list[SampleGroup] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    """What only this kind of call reports."""


class WholeCall:
    """Every request served to its end in one engine call; one group per prompt, in prompt order."""

    def check(self, num_groups: int | None) -> None:
        pass

    def serve(self, engine, requests: list[Request], groups: list[list[Request]],
              earlier_versions: dict[int, list[int]] | None, slots: dict[int, list[Sample | None]] | None) -> Served:
        results, steps, switches, decisions = (
            engine._on_ranks(worker_serve, [RequestRecord.of(r) for r in requests], engine._progress)
            if requests else ([], [], [], []))
        by_id = {r.request_id: r for r in results}
        out = [make_group(i, reqs, by_id, engine.weight_version, earlier_versions, (slots or {}).get(i))
               for i, reqs in enumerate(groups)]
        return Served(results, steps, switches, decisions, out)


class LoopCall:
    """Every request through the serving loop (rollout/serving_loop.py), beside the submitted requests
    in flight: a ``generate`` call made while the loop serves. Its timeline and metrics cover the
    steps that ran while it did (shared with what else ran)."""

    def check(self, num_groups: int | None) -> None:
        pass

    def serve(self, engine, requests: list[Request], groups: list[list[Request]],
              earlier_versions: dict[int, list[int]] | None, slots: dict[int, list[Sample | None]] | None) -> Served:
        from splash_rollout.rollout.serving_loop import RequestHandle

        loop = engine._serving_loop()
        log = loop.log
        start = (log.total_steps, len(log.switches), len(log.decisions))
        handle = RequestHandle(loop, requests, lambda results, versions, version: dict(results))
        loop.submit(requests, handle)
        by_id = handle.result()
        ran = log.total_steps - start[0]
        steps = log.steps[len(log.steps) - min(ran, len(log.steps)):]
        out = [make_group(i, reqs, by_id, engine.weight_version, earlier_versions, (slots or {}).get(i))
               for i, reqs in enumerate(groups)]
        return Served(list(by_id.values()), steps, log.switches[start[1]:], log.decisions[start[2]:], out)


@dataclass(frozen=True)
class StreamingCall:
    """Served poll by poll; finished groups judged by ``on_group`` and the call cut at ``target_groups``."""

    on_group: Callable[[SampleGroup], bool] | None
    target_groups: int | None
    poll_steps: int

    def check(self, num_groups: int | None) -> None:
        check_stream_args(self.on_group, self.target_groups, self.poll_steps, num_groups)

    def serve(self, engine, requests: list[Request], groups: list[list[Request]],
              earlier_versions: dict[int, list[int]] | None, slots: dict[int, list[Sample | None]] | None) -> Served:
        results, steps, switches, decisions, by_verdict = serve_streaming(
            engine, requests, groups, self.on_group, self.target_groups, self.poll_steps, earlier_versions, slots)
        kept, filtered, aborted = by_verdict[KEPT], by_verdict[FILTERED], by_verdict[ABORTED]
        return Served(results, steps, switches, decisions, kept, filtered, aborted,
                      {"rollout/kept_groups": float(len(kept)), "rollout/filtered_groups": float(len(filtered)),
                       "rollout/aborted_groups": float(len(aborted))})


def call_mode(on_group: Callable[[SampleGroup], bool] | None, target_groups: int | None,
              poll_steps: int) -> WholeCall | StreamingCall:
    """Streaming when ``on_group`` or ``target_groups`` is given, else whole."""
    if on_group is None and target_groups is None:
        return WholeCall()
    return StreamingCall(on_group, target_groups, poll_steps)
