"""Multi-turn rollouts with a tool: generate, answer the samples that called it, continue them, repeat.

    batch = engine.generate(prompts, sampling)                       # turn 1, every sample
    while some sample's last turn ended in a call (and turns, tokens remain):
        replies = env.reply_ids(that turn)                           # environment tokens
        more    = engine.continue_samples(calling, replies, n=1)     # the next turn of each
        put each continued sample back in its group, in its place

A continued sample carries its whole trajectory as one response -- the turns it sampled (loss mask
1) and the replies between them (loss mask 0, logprob 0) -- so the trainer sees every token with the
environment's masked out. The token budget is the trajectory's: ``sampling.max_new_tokens`` bounds
the whole response, replies included, as in a single-turn rollout. A call that cannot be answered
(the ``max_turns``-th turn called, or the reply leaves no token for another turn) ends the sample
with finish_reason ``length``: cut by a limit, like a truncated response.

``MultiTurnEngine`` puts this behind ``generate``, so the GRPO loop and held-out evaluation roll out
with the tool without changing; ``tool/*`` records of the call ride in ``batch.metrics``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

from splash_rollout.rollout.engine import RolloutEngine, derive_seed
from splash_rollout.rollout.call_timeline import layout_metrics
from splash_rollout.rollout.types import RolloutBatch, SamplingParams, Timeline

SUMMED = ("rollout/retractions", "rollout/prefix_hit_tokens", "rollout/prefill_rows", "perf/steps",
          "timing_s/generate", "rollout/aborted_samples", "spec/draft_tokens", "spec/accepted_tokens", "spec/steps_on")
"""Per-call counts a multi-turn batch adds up over its turns (maxima: ``MAXED``; the rest is turn 1's)."""
MAXED = ("memory/kv_used_peak", "perf/max_running", "perf/control_bytes_max")


class ToolEnv(Protocol):
    """What the loop needs of an environment (``tool_env.CalculatorEnv`` is one)."""

    stop_token_ids: tuple[int, ...]

    def called(self, turn_ids: list[int], finish_reason: str) -> bool: ...

    def reply_ids(self, turn_ids: list[int]) -> tuple[list[int], bool]: ...


@dataclasses.dataclass
class _Track:
    """Where one sample stands: its turns so far and where its last turn begins in the response."""
    turns: int = 1
    turn_start: int = 0
    calls: int = 0


def multi_turn_generate(engine: RolloutEngine, env: ToolEnv, prompts: Sequence[Any], sampling: SamplingParams,
                        max_turns: int) -> RolloutBatch:
    """Groups of ``sampling.n`` multi-turn trajectories, one group per prompt, in prompt order."""
    if max_turns < 1:
        raise ValueError(f"max_turns: expected >= 1, got {max_turns}")
    stops = tuple(dict.fromkeys(tuple(sampling.stop_token_ids) + tuple(env.stop_token_ids)))
    sampling = dataclasses.replace(sampling, stop_token_ids=stops)
    batch = engine.generate(prompts, sampling)
    places = [(g, k) for g in range(len(batch.groups)) for k in range(len(batch.groups[g].samples))]
    track = {p: _Track() for p in places}
    calls = errors = env_tokens = cut = 0
    turn_batches = [batch]
    while True:
        todo, replies, params = [], [], []
        for flat, (g, k) in enumerate(places):
            s, t = batch.groups[g].samples[k], track[(g, k)]
            turn = s.response_ids[t.turn_start:]
            if not env.called(turn, s.finish_reason):
                continue
            reply, bad = env.reply_ids(turn)
            budget = sampling.max_new_tokens - len(s.response_ids) - len(reply)
            if t.turns >= max_turns or budget < 1:
                batch.groups[g].samples[k] = dataclasses.replace(s, finish_reason="length")
                cut += 1
                continue
            seed = None if sampling.seed is None else derive_seed(sampling.seed, t.turns, flat)
            todo.append((g, k))
            replies.append(reply)
            params.append(dataclasses.replace(sampling, n=1, max_new_tokens=budget, seed=seed))
            errors += int(bad)
        if not todo:
            break
        more = engine.continue_samples([batch.groups[g].samples[k] for g, k in todo], replies, params)
        turn_batches.append(more)
        for (g, k), reply, group in zip(todo, replies, more.groups):
            t = track[(g, k)]
            t.turn_start = len(batch.groups[g].samples[k].response_ids) + len(reply)
            t.turns, t.calls = t.turns + 1, t.calls + 1
            batch.groups[g].samples[k] = group.samples[0]
            calls, env_tokens = calls + 1, env_tokens + len(reply)
    num = max(1, len(places))
    timeline = merge_timelines([b.timeline for b in turn_batches])
    metrics = merge_metrics([b.metrics for b in turn_batches])
    metrics.update(layout_metrics(timeline))
    metrics.update({"tool/calls_per_sample": calls / num,
                    "tool/samples_calling": sum(t.calls > 0 for t in track.values()) / num,
                    "tool/turns_mean": sum(t.turns for t in track.values()) / num,
                    "tool/errors": float(errors), "tool/env_tokens": float(env_tokens),
                    "tool/cut_by_limit": float(cut)})
    return RolloutBatch(batch.groups, timeline, metrics)


def merge_metrics(per_turn: list[dict[str, float]]) -> dict[str, float]:
    """One record for a multi-turn call: counts summed over the turns, peaks maxed, the rest turn 1's
    (response lengths are left out: only the merged samples know them)."""
    out = {k: v for k, v in per_turn[0].items() if not k.startswith("rollout/response_len/")}
    for key in SUMMED:
        if key in out:
            out[key] = float(sum(m.get(key, 0.0) for m in per_turn))
    for key in MAXED:
        if key in out:
            out[key] = float(max(m.get(key, 0.0) for m in per_turn))
    return out


def merge_timelines(timelines: list[Timeline]) -> Timeline:
    """The turns' timelines end to end: each later call's times and step numbers shifted past the
    previous ones (a call's times start at 0 and its steps at 0)."""
    out = Timeline()
    t0, step0 = 0.0, 0
    for tl in timelines:
        for p in tl.phases:
            q = dict(p, t_start=p["t_start"] + t0, t_end=p["t_end"] + t0)
            for curve in ("batch_curve", "memory_curve"):
                if curve in p:
                    q[curve] = [[pt[0] + t0, *pt[1:]] for pt in p[curve]]
            out.phases.append(q)
        out.switches += [dict(s, step=s["step"] + step0) if s.get("step") is not None else dict(s)
                         for s in tl.switches]
        out.decisions += [dict(d, step=d["step"] + step0) if d.get("step") is not None else dict(d)
                          for d in tl.decisions]
        t0 = max([t0] + [p["t_end"] + t0 for p in tl.phases])
        step0 += sum(p.get("steps", 0) for p in tl.phases)
    return out


class MultiTurnEngine:
    """A ``RolloutEngine`` whose ``generate`` rolls out with a tool (``multi_turn_generate``); every
    other method and property is the wrapped engine's. Streaming calls are refused: a group's
    samples finish in different turns."""

    def __init__(self, engine: RolloutEngine, env: ToolEnv, max_turns: int) -> None:
        self._engine, self._env, self._max_turns = engine, env, max_turns

    def generate(self, prompts: Sequence[Any], sampling: SamplingParams | None = None, *,
                 on_group=None, target_groups=None, **unused) -> RolloutBatch:
        if on_group is not None or target_groups is not None or unused:
            raise ValueError("multi-turn generate: streaming options (on_group, target_groups, poll_steps) are not "
                             "supported with a tool; set grpo.oversample_groups=null")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise TypeError(f"multi-turn generate: sampling: expected one SamplingParams, "
                            f"got {type(sampling).__name__}")
        return multi_turn_generate(self._engine, self._env, prompts, sampling or SamplingParams(), self._max_turns)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

