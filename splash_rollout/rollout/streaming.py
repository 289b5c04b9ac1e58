"""Streaming a generate call group by group, and stopping it once enough groups are good.

RL recipes over-sample (DAPO): they ask for more prompts than they train on and keep the first
groups that pass a filter (e.g. rewards that are not all equal), so the slowest groups of the call
never hold up the step. ``RolloutEngine.generate(..., on_group=..., target_groups=...)`` runs here:

* the call is served in polls of ``poll_steps`` engine steps (``Engine.serve(max_steps=...)``: the
  unfinished requests stay in the engine between polls), and after each poll the groups whose every
  sample has finished go to ``on_group(group) -> bool`` in the calling process, in the order they
  completed (under torchrun every rank calls it and rank 0's answers are used);
* ``True`` keeps the group, ``False`` filters it out; once ``target_groups`` groups are kept, the
  rest of the call is aborted at the next step boundary (the engine's ``should_abort``: the same
  path as ``RolloutEngine.abort()``), and ``generate`` returns.

Every group of the call ends in exactly one of ``RolloutBatch.groups`` (kept),
``RolloutBatch.filtered`` (finished, rejected by ``on_group``) or ``RolloutBatch.aborted`` (not
used: cut off when the target was met or by ``abort()``, or finished in the poll that met the
target after the target-reaching group); nothing is dropped unseen.

Between polls the auto layout policy keeps its decision history, but its residual-length estimate
starts over with each poll (the engine treats each ``serve`` as a new call), so under
``layout="auto"`` a larger ``poll_steps`` keeps that estimate closer to a plain call's.
"""
from __future__ import annotations

from typing import Callable

from splash_rollout.engine.request import Request
from splash_rollout.rollout.ranks import RequestRecord, RequestResult
from splash_rollout.rollout.types import Sample, SampleGroup

KEPT, FILTERED, ABORTED = "kept", "filtered", "aborted"


def make_group(index: int, requests: list[Request], by_id: dict[int, RequestResult], version: int,
               earlier_versions: dict[int, list[int]] | None = None,
               slots: list[Sample | None] | None = None) -> SampleGroup:
    """Group ``index`` of a call from its requests and their results. ``earlier_versions``: request id
    -> weight versions of the tokens a resumed sample brought in (the rest were sampled under ``version``).
    ``slots``: the group's samples in order, finished ones given (kept as they are) and None where the
    next request's result goes; None: one sample per request."""
    made = []
    for r in requests:
        res = by_id[r.request_id]
        before = (earlier_versions or {}).get(r.request_id, [])
        versions = list(before) + [version] * (len(res.output_ids) - len(before))
        made.append(Sample(list(r.prompt_ids), list(res.output_ids), list(res.output_logprobs), res.finish_reason,
                           r.spec.seed, version, versions, r.spec, res.routing))
    if slots is None:
        return SampleGroup(index, made)
    fill = iter(made)
    return SampleGroup(index, [s if s is not None else next(fill) for s in slots])


# ---- what every rank runs (module level so they pickle by name) ----------------------------------------
def worker_serve_poll(ctx, records: list[RequestRecord], max_steps: int | None, first: bool):
    """One poll: add ``records`` (the call's requests, on the first poll) and serve up to
    ``max_steps`` steps. Rank 0 returns (results finished in this poll, step log, switch log, new
    decisions); the policy's decision history is kept across polls of a call."""
    engine = ctx.state["engine"]
    if first:
        engine.driver.decision_log = []
        ctx.state["decisions_seen"] = 0
    finished = engine.serve([r.request() for r in records], max_steps=max_steps)
    if finished is None:
        return None
    results = [RequestResult(r.request_id, list(r.output_ids), list(r.output_logprobs), r.finish_reason or "abort",
                             engine.routing.take(r) if engine.routing is not None else None)
               for r in finished]
    seen = ctx.state.get("decisions_seen", 0)
    decisions = engine.decision_log[seen:]
    ctx.state["decisions_seen"] = len(engine.decision_log)
    steps, switches = engine.step_log, engine.switch_log
    engine.step_log, engine.switch_log = [], []
    return results, steps, switches, decisions


def worker_end_stream(ctx) -> None:
    """After the last poll: the next call starts with an empty decision log, as after a plain call."""
    ctx.state["engine"].driver.decision_log = []
    ctx.state.pop("decisions_seen", None)


# ---- the caller's side ----------------------------------------------------------------------------------
def check_stream_args(on_group, target_groups, poll_steps, num_groups: int | None) -> None:
    """Before any request is built (``num_groups``: the call's prompts, None when not countable yet)."""
    if on_group is not None and not callable(on_group):
        raise TypeError(f"on_group: expected a callable taking a SampleGroup and returning a bool, "
                        f"got {type(on_group).__name__}")
    if target_groups is not None and (not isinstance(target_groups, int) or isinstance(target_groups, bool)
                                      or not 1 <= target_groups):
        raise ValueError(f"target_groups: expected an integer >= 1 (or None), got {target_groups!r}")
    if target_groups is not None and num_groups is not None and target_groups > num_groups:
        raise ValueError(f"target_groups: {target_groups} is more than the call's {num_groups} prompts")
    if not isinstance(poll_steps, int) or isinstance(poll_steps, bool) or poll_steps < 1:
        raise ValueError(f"poll_steps: expected an integer >= 1, got {poll_steps!r}")


def serve_streaming(engine, requests: list[Request], groups: list[list[Request]],
                    on_group: Callable[[SampleGroup], bool] | None, target_groups: int | None, poll_steps: int,
                    earlier_versions: dict[int, list[int]] | None = None,
                    slots: dict[int, list[Sample | None]] | None = None):
    """Serve a call poll by poll (``engine``: the RolloutEngine). Returns (results, steps, switches,
    decisions, {KEPT: groups, FILTERED: groups, ABORTED: groups}); kept and filtered groups are in
    the order they completed (the objects ``on_group`` saw), aborted ones in prompt order.
    ``earlier_versions`` and ``slots``: resumed samples and groups (``make_group``); a group with no
    request left (every sample already finished) is complete before the first poll."""
    group_at = lambda g: make_group(g, groups[g], by_id, engine.weight_version, earlier_versions,  # noqa: E731
                                    (slots or {}).get(g))
    group_of = {r.request_id: i for i, g in enumerate(groups) for r in g}
    left = [len(g) for g in groups]
    by_id: dict[int, RequestResult] = {}
    steps, switches, decisions = [], [], []
    verdicts: list[str | None] = [None] * len(groups)
    built: dict[int, SampleGroup] = {}
    order: list[int] = []
    kept = 0
    first, aborting = True, False

    def poll(records, max_steps) -> list[RequestResult]:
        results, s, w, d = engine._on_ranks(worker_serve_poll, records, max_steps, first)
        steps.extend(s)
        switches.extend(w)
        decisions.extend(d)
        return results

    try:
        while first or len(by_id) < len(requests):
            records = [RequestRecord.of(r) for r in requests] if first else []
            done: list[int] = [g for g in range(len(groups)) if not groups[g]] if first else []
            results = poll(records, None if aborting else poll_steps) if requests else []
            first = False
            for res in results:
                by_id[res.request_id] = res
                g = group_of[res.request_id]
                left[g] -= 1
                if left[g] == 0:
                    done.append(g)
            judged = []
            for g in done:
                built[g] = group_at(g)
                order.append(g)
                if aborting or (target_groups is not None and kept >= target_groups) or \
                        any(s.finish_reason == "abort" for s in built[g].samples):
                    verdicts[g] = ABORTED
                    continue
                ok = True if on_group is None else bool(on_group(built[g]))
                judged.append(ok)
                verdicts[g] = KEPT if ok else FILTERED
                kept += ok
            if judged and engine._host.every_rank_calls:  # every rank keeps rank 0's verdicts
                answers = engine._host.control.broadcast_object([verdicts[g] for g in done])
                kept = kept - sum(verdicts[g] == KEPT for g in done) + sum(a == KEPT for a in answers)
                for g, a in zip(done, answers):
                    verdicts[g] = a
            if target_groups is not None and kept >= target_groups and len(by_id) < len(requests) and not aborting:
                aborting = True  # the next poll's first boundary aborts the rest (should_abort)
                engine._abort.set()
                engine._host.interrupt()
    except BaseException:
        if len(by_id) < len(requests) and engine._broken is None:
            engine._abort.set()  # leave no request of this call in the engine
            engine._host.interrupt()
            try:
                poll([], None)
            except BaseException:  # noqa: BLE001 - the first error is the one to raise
                pass
        raise
    finally:
        if engine._broken is None:
            try:
                engine._on_ranks(worker_end_stream)
            except BaseException:  # noqa: BLE001 - a failure here has already marked the engine broken
                pass
    sorted_groups = {KEPT: [], FILTERED: [], ABORTED: []}
    for g in order:
        if verdicts[g] != ABORTED:
            sorted_groups[verdicts[g]].append(built[g])
    sorted_groups[ABORTED] = [built.get(g) or group_at(g) for g in range(len(groups)) if verdicts[g] in (None, ABORTED)]
    return list(by_id.values()), steps, switches, decisions, sorted_groups
