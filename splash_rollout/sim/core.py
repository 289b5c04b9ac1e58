"""Continuous-batching event simulation on the cost model: what these CPUs cannot run.

One group serves a queue of requests in one fixed layout, or adaptively under π with switch costs
charged. Each step admits FCFS while the layout's pools hold every running request's reservation
(prompt + max_new_tokens, the ownership model's fit rule; owners by least projected KV), runs up to
``chunk_tokens`` prefill rows next to one decode row per decoding request, and retires requests at
their sampled lengths. Prefill rows go FCFS over the group for TP / CP and FCFS per owner with
``chunk_tokens / T`` each for DP-attention / DOP (each owner schedules its own requests, as
SGLang's DP-attention does). While nothing prefills and nothing can be admitted, the batch only
grows by one token per request per step, so the simulation jumps to the next finish in one stride
priced at the stride's midpoint context (step cost is close to linear in context).

Times in seconds, lengths in tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from splash_rollout.layout import Layout, fits
from splash_rollout.scheduling import Deployment, LayoutPolicy, PolicyConfig, StepBatch, choose_owner, step_time
from splash_rollout.scheduling.policy import Waiting

ADAPTIVE = "adaptive"


@dataclass(frozen=True)
class Workload:
    prompt: np.ndarray
    """[R] int64 prompt tokens."""
    output: np.ndarray
    """[R] int64 response tokens each request actually generates (>= 1)."""
    max_new: np.ndarray
    """[R] int64 max_new_tokens (what admission reserves); >= output."""

    @classmethod
    def make(cls, prompt, output, max_new=None) -> "Workload":
        p = np.asarray(prompt, dtype=np.int64).reshape(-1)
        o = np.broadcast_to(np.asarray(output, dtype=np.int64), p.shape).copy()
        m = o.copy() if max_new is None else np.broadcast_to(np.asarray(max_new, dtype=np.int64), p.shape).copy()
        if (p < 1).any() or (o < 1).any() or (m < o).any():
            raise ValueError("workload: expected prompt >= 1, 1 <= output <= max_new")
        return cls(p, o, m)

    @property
    def size(self) -> int:
        return int(self.prompt.size)

    @property
    def total_tokens(self) -> int:
        return int(self.prompt.sum() + self.output.sum())


@dataclass(frozen=True)
class SimConfig:
    chunk_tokens: int = 16384
    """Prefill rows per step over the whole group."""
    max_running: int = 1024
    max_stride: int = 2048
    """Longest decode stride priced at one midpoint."""
    progress_points: int = 300
    policy: PolicyConfig = PolicyConfig()


@dataclass
class SimResult:
    mode: str
    seconds: float
    tokens: int
    steps: int
    finish_time: np.ndarray
    """[R] seconds at which each request finished (nan: never)."""
    timeline: list = field(default_factory=list)
    switches: list = field(default_factory=list)
    progress: list = field(default_factory=list)
    """[(t, tokens done)] samples."""
    reason: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 and math.isfinite(self.seconds) else 0.0


def _prefill_rows(idx: np.ndarray, left: np.ndarray, owners: np.ndarray, layout: Layout, chunk: int, t: int) -> np.ndarray:
    """Rows per prefilling request this step (FCFS in ``idx`` order). [len(idx)] int64."""
    def fcfs(rem: np.ndarray, budget: int) -> np.ndarray:
        before = np.cumsum(rem) - rem
        return np.clip(budget - before, 0, rem)
    if layout in (Layout.DP, Layout.DOP):
        q = np.zeros_like(left)
        for r in range(t):
            m = owners[idx] == r
            if m.any():
                q[m] = fcfs(left[m], max(chunk // t, 1))
        return q
    return fcfs(left, chunk)


def simulate(work: Workload, dep: Deployment, mode: Layout | str, cfg: SimConfig = SimConfig()) -> SimResult:
    adaptive = mode == ADAPTIVE
    layout = None if adaptive else Layout.parse(mode, "layout")
    t_ranks, pools = dep.world_size, dep.pools
    n_req = work.size
    reserve = work.prompt + work.max_new
    owner = np.full(n_req, -1, dtype=np.int64)
    prefilled = np.zeros(n_req, dtype=np.int64)
    generated = np.zeros(n_req, dtype=np.int64)
    finish = np.full(n_req, np.nan)
    policy = LayoutPolicy(dep, cfg.policy) if adaptive else None
    proj = np.zeros(t_ranks, dtype=np.int64)
    running: list[int] = []
    nxt, now, steps, done_tokens = 0, 0.0, 0, 0
    timeline: list[dict] = []
    switches: list[dict] = []
    progress = [(0.0, 0)]
    in_layout = 0

    def can_admit(l: Layout, i: int, o: int) -> bool:
        idx = np.asarray(running + [i], dtype=np.int64)
        own = owner[idx].copy()
        own[-1] = o
        return fits(l, reserve[idx], pools[l], t_ranks, own)

    if adaptive:
        layout = _initial_layout(work, dep, cfg)
    while nxt < n_req or running:
        while nxt < n_req and len(running) < cfg.max_running:
            o = choose_owner(proj, int(reserve[nxt]))
            if not can_admit(layout, nxt, o):
                break
            owner[nxt] = o
            proj[o] += reserve[nxt]
            running.append(nxt)
            nxt += 1
        if not running:
            return SimResult(str(mode), math.inf, done_tokens, steps, finish, timeline, switches, progress,
                             f"{layout.value}: request {nxt} ({int(reserve[nxt])} tokens) does not fit an empty group")
        run = np.asarray(running, dtype=np.int64)
        left = work.prompt[run] - prefilled[run]
        pre = left > 0
        if pre.any():
            q = np.zeros(run.size, dtype=np.int64)
            q[pre] = _prefill_rows(run[pre], left[pre], owner, layout, dep.chunk_tokens(layout, cfg.chunk_tokens),
                                   t_ranks)
            q[~pre] = 1
            ctx = np.where(pre, prefilled[run] + q, work.prompt[run] + generated[run] + 1)
            k = 1
        else:
            q = np.ones(run.size, dtype=np.int64)
            k = int(min((work.output[run] - generated[run]).min(), cfg.max_stride))
            ctx = work.prompt[run] + generated[run] + 1 + (k - 1) // 2
        batch = StepBatch.make(ctx, q, owner[run], sampling_rows=int((~pre | (q == left)).sum()),
                               prefill_done=int((pre & (q == left)).sum()))
        if adaptive:
            queued = slice(nxt, min(n_req, nxt + max(cfg.max_running - run.size, 0)))
            waiting = Waiting.make(work.prompt[queued], reserve[queued], cfg.chunk_tokens, cfg.max_running)
            d = policy.decide(layout, batch, work.max_new[run] - generated[run], in_layout, reserve[run], waiting)
            if d.switch:
                now += d.switch_cost_s
                switches.append({"t": now, "step": steps, "src": layout.value, "dst": d.chosen.value,
                                 "exposed_s": d.switch_cost_s, "blocking_s": d.blocking_cost_s,
                                 "batch": int(run.size), "reason": d.reason})
                layout, in_layout = d.chosen, 0
            # the running batch (the chosen layout's pool admits the queue from the next step on)
            sec = step_time(layout, batch, dep.model, dep.profile, dep.sizes).seconds
        else:
            sec = step_time(layout, batch, dep.model, dep.profile, dep.sizes).seconds
        if not timeline or timeline[-1]["layout"] != layout.value:
            timeline.append({"layout": layout.value, "t_start": now, "t_end": now, "steps": 0,
                             "batch_max": 0, "tokens": 0})
        now += sec * k
        steps += k
        in_layout += k
        # advance the requests
        newly = 0
        if pre.any():
            newly += int(q[pre].sum())
            prefilled[run[pre]] += q[pre]
            first = pre & (prefilled[run] == work.prompt[run])
            generated[run[first]] += 1
            generated[run[~pre]] += 1
            newly += int(first.sum() + (~pre).sum())
        else:
            generated[run] += k
            newly += k * run.size
        done_tokens += newly
        seg = timeline[-1]
        seg.update(t_end=now, steps=seg["steps"] + k, batch_max=max(seg["batch_max"], int(run.size)),
                   tokens=seg["tokens"] + newly)
        fin = run[(prefilled[run] == work.prompt[run]) & (generated[run] >= work.output[run])]
        if fin.size:
            finish[fin] = now
            np.subtract.at(proj, owner[fin], reserve[fin])
            gone = set(fin.tolist())
            running = [i for i in running if i not in gone]
        progress.append((now, done_tokens))
    if len(progress) > cfg.progress_points:
        pick = np.linspace(0, len(progress) - 1, cfg.progress_points).astype(int)
        progress = [progress[i] for i in pick]
    return SimResult(str(mode.value if isinstance(mode, Layout) else mode), now, done_tokens, steps, finish,
                     timeline, switches, progress)


def _initial_layout(work: Workload, dep: Deployment, cfg: SimConfig) -> Layout:
    """Adaptive start: the layout with the most tokens per second in the steady state of the batch it
    would admit first -- every admitted request decoding while the next prompts prefill within the
    layout's chunk budget (admission and layout chosen together only here; π takes over afterwards).
    A layout whose larger pool admits more is not chosen for that alone: the batch it admits must
    also run faster per token."""
    best, best_rate = None, -1.0
    for l in cfg.policy.layouts:
        proj = np.zeros(dep.world_size, dtype=np.int64)
        idx, own = [], []
        for i in range(min(work.size, cfg.max_running)):
            o = choose_owner(proj, int(work.prompt[i] + work.max_new[i]))
            if not fits(l, (work.prompt + work.max_new)[idx + [i]], dep.pools[l], dep.world_size, np.asarray(own + [o])):
                break
            idx.append(i)
            own.append(o)
            proj[o] += work.prompt[i] + work.max_new[i]
        if not idx:
            continue
        decode = StepBatch.make(work.prompt[idx] + 1, 1, own)
        rate = len(idx) / step_time(l, decode, dep.model, dep.profile, dep.sizes).seconds
        # the same batch with a prefill chunk riding along: the next prompts, split over the owners
        # for DP-attention / DOP as the engine schedules them
        budget = dep.chunk_tokens(l, cfg.chunk_tokens)
        plen = int(np.median(work.prompt[: max(len(idx), 1)]))
        nxt = np.arange(len(idx), min(work.size, len(idx) + max(1, -(-budget // plen))))
        if nxt.size:
            chunk = np.minimum(work.prompt[nxt], max(budget // max(nxt.size, 1), 1))
            mixed = StepBatch.make(np.concatenate([work.prompt[idx] + 1, chunk]),
                                   np.concatenate([np.ones(len(idx), dtype=np.int64), chunk]),
                                   np.concatenate([own, np.arange(nxt.size) % dep.world_size]),
                                   prefill_done=min(nxt.size, int(round(chunk.sum() / plen))))  # steady state
            rate = min(rate, (len(idx) + int(chunk.sum()))
                       / step_time(l, mixed, dep.model, dep.profile, dep.sizes).seconds)
        if rate > best_rate:
            best, best_rate = l, rate
    if best is None:
        raise ValueError("workload: the first request fits no layout")
    return best
