"""Continuous-batching event simulation on the cost model: what these CPUs cannot run.

One group serves a queue of requests in one fixed layout, or adaptively under π with switch costs
charged. Admission is the engine's own rule (``scheduling.admission``): each running request is
expected to reach ``num_tokens + ceil(ratio * (cap - num_tokens))`` tokens, with the ratio decaying
per step while memory holds and bumped by every retraction; ``worst_case`` admission reserves the
cap. A step admits FCFS while the layout's pools hold every running request's expected total
(owners by least projected KV, the next rank tried when the least-loaded one is full); when the
step's real KV (each request's computed tokens plus this step's rows) would overflow a pool, the
youngest requests are retracted -- their KV freed, their tokens kept, prefilled again from the
queue's head -- or, adaptively, π prices a switch to a layout that holds the batch against that
retraction, as the engine's driver does. The switch horizon is the engine's too: the median
residual length learned from the drain's finished responses (``scheduling.horizon``).

Each step runs up to ``chunk_tokens`` prefill rows next to one decode row per decoding request, and
retires requests at their sampled lengths. Prefill rows go FCFS over the group for TP / CP and FCFS
per owner with ``chunk_tokens / T`` each for DP-attention / DOP (each owner schedules its own
requests, as SGLang's DP-attention does). While nothing prefills and admission cannot change (the
ratio at its floor, so expected totals only grow until a request finishes), the batch only grows by
one token per request per step, so the simulation jumps to the next finish -- or to the step the
real KV would overflow a pool -- in one stride priced at the stride's midpoint context (step cost
is close to linear in context).

Times in seconds, lengths in tokens.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from splash_rollout.scheduling.admission import AdmissionSettings, GrowthEstimate
from splash_rollout.layout import Layout, fits
from splash_rollout.layout.fit import rank_demand
from splash_rollout.scheduling import Deployment, LayoutPolicy, PolicyConfig, StepBatch, choose_owner, step_time
from splash_rollout.scheduling.horizon import residual_tokens
from splash_rollout.scheduling.phase import prefill_in_phase
from splash_rollout.scheduling.admission_plan import Waiting

ADAPTIVE = "adaptive"


@dataclass(frozen=True)
class Workload:
    prompt: np.ndarray
    """[R] int64 prompt tokens."""
    output: np.ndarray
    """[R] int64 response tokens each request actually generates (>= 1)."""
    max_new: np.ndarray
    """[R] int64 max_new_tokens (the cap admission's estimate grows towards); >= output."""

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
    decay_stride: int = 16
    """Longest decode stride while the admission ratio still decays with requests queued (admission
    may open at any of those steps)."""
    progress_points: int = 300
    admission: AdmissionSettings = AdmissionSettings()
    policy: PolicyConfig = PolicyConfig(price_phase=True)


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
    retractions: int = 0
    """Requests retracted (KV freed, prefilled again) over the run."""
    decisions: list = field(default_factory=list)
    """The policy's switching decisions (adaptive only), each with its reason and per-layout costs."""

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


def _decay_steps_left(est: GrowthEstimate) -> int:
    """Steps until the admission ratio reaches its floor (0 once there, or under worst-case)."""
    s = est.settings
    if not est.optimistic or est.ratio <= s.min_ratio:
        return 0
    return math.ceil((est.ratio - s.min_ratio) * s.decay_steps / (s.init_ratio - s.min_ratio) - 1e-9)


def _longest_fitting_stride(layout: Layout, kv: np.ndarray, owners: np.ndarray, pool: int, t: int, k: int) -> int:
    """Most decode steps (<= k) after which every request's KV (``kv`` + steps) still fits."""
    lo, hi = 0, k
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if rank_demand(layout, kv + mid, t, owners) <= pool:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Run:
    """The state of one simulated group: per-request token counts, the running list (admission order,
    the youngest last) and the queue (retracted requests back at its head)."""

    def __init__(self, work: Workload, dep: Deployment, cfg: SimConfig):
        n = work.size
        self.work, self.dep, self.cfg = work, dep, cfg
        self.cap = work.prompt + work.max_new
        """[R] int64: tokens each request may reach."""
        self.generated = np.zeros(n, dtype=np.int64)
        self.computed = np.zeros(n, dtype=np.int64)
        """[R] int64: tokens whose KV the request holds now."""
        self.owner = np.full(n, -1, dtype=np.int64)
        self.expected = np.zeros(n, dtype=np.int64)
        """[R] int64: the admission estimate each running request is held at (its projected KV)."""
        self.proj = np.zeros(dep.world_size, dtype=np.int64)
        self.running: list[int] = []
        self.queue: deque[int] = deque(range(n))
        self.estimate = GrowthEstimate(cfg.admission)
        self.retractions = 0
        self.ended: tuple[list[int], list[int]] = ([], [])
        """Response lengths of the finished requests that stopped and that hit their cap (what the
        horizon estimate learns from, as the engine's driver keeps them)."""

    def num_tokens(self, idx) -> np.ndarray:
        return self.work.prompt[idx] + self.generated[idx]

    def expected_total(self, idx) -> np.ndarray:
        """[len(idx)] int64: tokens each request is expected to reach, by the engine's rule."""
        n, cap = self.num_tokens(idx), self.cap[idx]
        return np.fromiter((self.estimate.expected_total(int(a), int(b)) for a, b in zip(n, cap)),
                           dtype=np.int64, count=len(n))

    def refresh_expected(self) -> None:
        """Re-estimate the running requests (their tokens and the ratio moved) and the owners' load."""
        run = np.asarray(self.running, dtype=np.int64)
        self.expected[run] = self.expected_total(run)
        self.proj = np.bincount(self.owner[run], weights=self.expected[run],
                                minlength=self.dep.world_size).astype(np.int64)

    def admit(self, layout: Layout, forbid: set[int]) -> None:
        """FCFS from the queue head while the layout's pools hold every expected total."""
        pools, t = self.dep.pools[layout], self.dep.world_size
        run = np.asarray(self.running, dtype=np.int64)
        held, owners = list(self.expected[run]), list(self.owner[run])
        while self.queue and len(self.running) < self.cfg.max_running and self.queue[0] not in forbid:
            i = self.queue[0]
            e = int(self.expected_total([i])[0])
            order = [choose_owner(self.proj)] if layout.ownership.name in ("EVERY", "POSITIONS") else \
                list(np.argsort(self.proj, kind="stable"))
            for o in order:
                if fits(layout, np.asarray(held + [e], dtype=np.int64), pools, t, np.asarray(owners + [int(o)])):
                    break
            else:
                return  # FIFO: the head waits, and so does everything behind it
            self.queue.popleft()
            self.owner[i], self.expected[i] = int(o), e
            self.proj[int(o)] += e
            held.append(e)
            owners.append(int(o))
            self.running.append(i)

    def overflowing(self, layout: Layout, after: np.ndarray) -> bool:
        run = np.asarray(self.running, dtype=np.int64)
        return not fits(layout, after, self.dep.pools[layout], self.dep.world_size, self.owner[run])

    def victims(self, layout: Layout, after: np.ndarray) -> list[int]:
        """Positions in ``running`` the engine would retract (youngest first, the oldest always kept)
        so that ``after`` ([B] KV each holds after the step) fits."""
        keep = np.ones(len(self.running), dtype=bool)
        owners = self.owner[np.asarray(self.running, dtype=np.int64)]
        pool, t = self.dep.pools[layout], self.dep.world_size
        out = []
        for pos in range(len(self.running) - 1, 0, -1):
            if fits(layout, after[keep], pool, t, owners[keep]):
                break
            keep[pos] = False
            out.append(pos)
        return out

    def finished(self, idx: np.ndarray) -> None:
        w = self.work
        for i in idx.tolist():
            self.ended[bool(self.generated[i] >= w.max_new[i])].append(int(self.generated[i]))
        np.subtract.at(self.proj, self.owner[idx], self.expected[idx])
        gone = set(idx.tolist())
        self.running = [i for i in self.running if i not in gone]

    def retract(self, positions: list[int]) -> list[int]:
        gone = [self.running[p] for p in positions]
        for i in gone:  # youngest first: the oldest of them ends at the queue head
            self.computed[i] = 0
            self.proj[self.owner[i]] -= self.expected[i]
            self.owner[i] = -1
            self.queue.appendleft(i)
            self.estimate.retracted()
        drop = set(gone)
        self.running = [i for i in self.running if i not in drop]
        self.retractions += len(gone)
        return gone


def _horizon(st: _Run, idx: np.ndarray) -> np.ndarray:
    """[len(idx)] residual decode steps per request, as the engine's driver estimates them."""
    w = st.work
    return residual_tokens(st.generated[idx], w.max_new[idx], *st.ended)


def _rows(st: _Run, layout: Layout) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The running requests' rows this step in ``layout``: (run [B], rows left [B], prefilling [B] bool,
    query rows [B]). A request with one row left decodes (that row samples its next token)."""
    run = np.asarray(st.running, dtype=np.int64)
    left = st.num_tokens(run) - st.computed[run]
    pre = left > 1
    q = np.ones(run.size, dtype=np.int64)
    if pre.any():
        q[pre] = _prefill_rows(run[pre], left[pre], st.owner, layout,
                               st.dep.chunk_tokens(layout, st.cfg.chunk_tokens), st.dep.world_size)
    return run, left, pre, q


def _never_fits(work: Workload, dep: Deployment, layouts) -> str:
    """Why some request's cap fits no empty group in any of ``layouts`` ('' when every one fits one)."""
    cap = work.prompt + work.max_new
    for i in np.argsort(-cap)[:1]:
        if not any(fits(l, cap[i:i + 1], dep.pools[l], dep.world_size, np.zeros(1, dtype=np.int64)) for l in layouts):
            return f"{'/'.join(l.value for l in layouts)}: request {int(i)} ({int(cap[i])} tokens) does not fit an empty group"
    return ""


def _log_switch(switches: list, d, now: float, step: int, src: Layout, batch: int, cause: str) -> None:
    switches.append({"t": now, "step": step, "src": src.value, "dst": d.chosen.value, "exposed_s": d.switch_cost_s,
                     "blocking_s": d.blocking_cost_s, "batch": batch, "cause": cause,
                     "rule": None if d.rule is None else d.rule.value, "reason": d.reason,
                     "step_costs": {k: (None if math.isinf(v) else v) for k, v in d.step_costs.items()},
                     "admitted": dict(d.admitted), "horizon_steps": d.horizon_steps,
                     "seconds_per_token": {k: (None if math.isinf(v) else v) for k, v in d.seconds_per_token.items()}})


def simulate(work: Workload, dep: Deployment, mode: Layout | str, cfg: SimConfig = SimConfig()) -> SimResult:
    adaptive = mode == ADAPTIVE
    name = str(mode.value if isinstance(mode, Layout) else mode)
    layout = None if adaptive else Layout.parse(mode, "layout")
    t_ranks = dep.world_size
    st = _Run(work, dep, cfg)
    finish = np.full(work.size, np.nan)
    timeline: list[dict] = []
    switches: list[dict] = []
    progress = [(0.0, 0)]
    now, steps, done_tokens, in_layout = 0.0, 0, 0, 0
    why = _never_fits(work, dep, cfg.policy.layouts if adaptive else (layout,))
    if why:
        return SimResult(name, math.inf, 0, 0, finish, reason=why)
    policy = LayoutPolicy(dep, cfg.policy) if adaptive else None
    if adaptive:
        layout = _initial_layout(work, dep, cfg)
    prompt_done = np.zeros(work.size, dtype=np.int64)
    """[R] prompt tokens ever computed (a retracted request's second prefill is not new work)."""
    while st.queue or st.running:
        st.estimate.stepped()
        st.refresh_expected()
        forbid: set[int] = set()
        if st.running:
            run, left, pre, q = _rows(st, layout)
            after = st.computed[run] + q  # [B] KV each request holds after this step
            over = st.overflowing(layout, after)
            if adaptive:
                batch = StepBatch.make(after, q, st.owner[run])
                if over:
                    d = policy.relieve_pressure(layout, batch, _horizon(st, run), st.expected[run],
                                                np.zeros(t_ranks, dtype=np.int64), st.victims(layout, after))
                    cause = "pressure"
                else:
                    queued = np.fromiter(st.queue, dtype=np.int64, count=len(st.queue))[: cfg.max_running]
                    waiting = Waiting.make(st.num_tokens(queued) - st.computed[queued], st.expected_total(queued),
                                           cfg.chunk_tokens, cfg.max_running)
                    residual = _horizon(st, np.concatenate([run, queued]))
                    d = policy.decide(layout, batch, residual, in_layout, st.expected[run], waiting,
                                      prefill_in_phase(left[pre], residual[: run.size], waiting.prompt,
                                                       cfg.max_running, cfg.policy.horizon_quantile))
                    cause = "policy"
                if d.switch:
                    now += d.switch_cost_s
                    _log_switch(switches, d, now, steps, layout, run.size, cause)
                    layout, in_layout = d.chosen, 0
                    run, left, pre, q = _rows(st, layout)
                    after = st.computed[run] + q
                    over = st.overflowing(layout, after)
            if over:
                forbid = set(st.retract(st.victims(layout, after)))
        st.admit(layout, forbid)
        if not st.running:
            i = st.queue[0]
            return SimResult(name, math.inf, done_tokens, steps, finish, timeline, switches, progress,
                             f"{layout.value}: request {i} ({int(st.cap[i])} tokens) is not admitted to an "
                             f"empty group", st.retractions)
        run, left, pre, q = _rows(st, layout)
        k = 1
        if not pre.any():
            k = int(min((work.output[run] - st.generated[run]).min(), cfg.max_stride))
            if st.queue and _decay_steps_left(st.estimate):
                k = min(k, cfg.decay_stride)
            k = max(1, _longest_fitting_stride(layout, st.computed[run], st.owner[run], dep.pools[layout],
                                               t_ranks, k))
        done_pre = pre & (q == left)
        batch = StepBatch.make(st.computed[run] + q + (k - 1) // 2, q, st.owner[run],
                               sampling_rows=int((~pre | done_pre).sum()), prefill_done=int(done_pre.sum()))
        sec = step_time(layout, batch, dep.model, dep.profile, dep.sizes).seconds
        if not timeline or timeline[-1]["layout"] != layout.value:
            timeline.append({"layout": layout.value, "t_start": now, "t_end": now, "steps": 0,
                             "batch_max": 0, "tokens": 0})
        now += sec * k
        steps += k
        in_layout += k
        for _ in range(min(k - 1, _decay_steps_left(st.estimate))):
            st.estimate.stepped()  # the stride's other steps (the loop's head ran its first)
        # advance: prefill chunks (one that completes samples a token), decode rows (k each)
        st.computed[run] += np.where(pre, q, k)
        sampled = np.where(pre, done_pre.astype(np.int64), k)
        st.generated[run] += sampled
        new_prompt = np.minimum(st.computed[run], work.prompt[run])
        newly = int((np.maximum(new_prompt, prompt_done[run]) - prompt_done[run]).sum() + sampled.sum())
        prompt_done[run] = np.maximum(new_prompt, prompt_done[run])
        done_tokens += newly
        seg = timeline[-1]
        seg.update(t_end=now, steps=seg["steps"] + k, batch_max=max(seg["batch_max"], int(run.size)),
                   tokens=seg["tokens"] + newly)
        fin = run[st.generated[run] >= work.output[run]]
        if fin.size:
            finish[fin] = now
            st.finished(fin)
        progress.append((now, done_tokens))
    if len(progress) > cfg.progress_points:
        pick = np.linspace(0, len(progress) - 1, cfg.progress_points).astype(int)
        progress = [progress[i] for i in pick]
    return SimResult(name, now, done_tokens, steps, finish, timeline, switches, progress, "", st.retractions)


def _initial_layout(work: Workload, dep: Deployment, cfg: SimConfig) -> Layout:
    """Adaptive start: the layout with the most tokens per second in the steady state of the batch it
    would admit first (the engine's admission estimate at its initial ratio) -- every admitted request decoding while the next prompts prefill within the
    layout's chunk budget (admission and layout chosen together only here; π takes over afterwards).
    A layout whose larger pool admits more is not chosen for that alone: the batch it admits must
    also run faster per token."""
    best, best_rate = None, -1.0
    est = GrowthEstimate(cfg.admission)
    head = np.arange(min(work.size, cfg.max_running))
    hold = np.fromiter((est.expected_total(int(p), int(p + m)) for p, m in zip(work.prompt[head], work.max_new[head])),
                       dtype=np.int64, count=head.size)  # [H] what admission holds for each head request
    for l in cfg.policy.layouts:
        proj = np.zeros(dep.world_size, dtype=np.int64)
        idx, own = [], []
        for i in head.tolist():
            o = choose_owner(proj)
            if not fits(l, hold[idx + [i]], dep.pools[l], dep.world_size, np.asarray(own + [o])):
                break
            idx.append(i)
            own.append(o)
            proj[o] += hold[i]
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
