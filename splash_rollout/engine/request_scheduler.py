"""Scheduler: admission, chunked prefill under a per-step token budget, continuous batching, and the
memory rules that decide how many requests run -- prompt sharing and retraction.

Each step spends at most ``max_num_batched_tokens`` query rows: running requests in decode go first
(one row each), then running requests still in prefill continue, then waiting requests are
admitted in arrival order while their expected pages fit. A long prompt spans several steps
(chunked prefill); only the chunk that reaches the end of a request's known tokens samples.

Memory, in three rules (every rank's replica applies them identically):

* **Prompt sharing.** The samples of one prompt are admitted together with one owner: the first
  (the leader) prefills the prompt, the others (its followers) wait, then sample their first token
  from the leader's last prompt row and take the prompt's KV by reference (its partly filled last
  page copied, ``KVPlacement.fork``). A sample of a prompt admitted while another sample of it is
  live takes that sample's computed full prompt pages (``attach``) and computes only the rest.
* **Expected growth.** Admission counts what each running request is expected to still need
  (``scheduling/admission.py``), not its cap, so the wide phase runs as many requests as the pool holds.
* **Retraction.** When a step cannot get the pages its rows need, the youngest running requests
  give theirs back (tokens, logprobs and sampler draws kept) and wait at the queue head; re-admitted,
  they prefill what they had and continue with the draws they would have made.
* **Prefix cache.** A finished request's full computed pages stay in a cache (``prefix_cache.py``)
  until a request that starts with the same tokens takes them by reference -- the next turn of an
  agent, a prompt seen before -- or memory runs short: pages only the cache holds count as free and
  are evicted, least recently used first, before anything is retracted.

With a ``Drafter`` (speculative decoding, engine/drafter.py) a decoding request may run 1 + k rows:
its last token and k drafted ones, every row sampled with the draw of the token it would produce
(``ScheduledSeq.draft``). ``postprocess`` keeps the drafted tokens up to the first one the sampled
token differs from, and that sampled token: exactly the tokens decoding one at a time would give.
The pages of the drafted positions come from the request's own reservation (a draft never reaches
past its cap); where a step's pages are short, drafts are dropped before anything is retracted.
Pages of rejected positions stay with the request and take its next tokens.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from splash_rollout.scheduling.admission import AdmissionSettings, GrowthEstimate
from splash_rollout.engine.drafter import credit
from splash_rollout.engine.page_manager import num_pages_for
from splash_rollout.engine.placement import KVPlacement, PageCopy
from splash_rollout.engine.prefix_cache import PrefixCache
from splash_rollout.engine.request import Request, RequestStatus
from splash_rollout.layout.layouts import Layout

if TYPE_CHECKING:
    from splash_rollout.engine.drafter import Drafter


@dataclass
class ScheduledSeq:
    request: Request
    num_new: int
    """Query rows this step."""
    forks: list[Request] = field(default_factory=list)
    """Followers that sample their first token from this (prompt-completing) chunk's last row."""
    draft: tuple[int, ...] = ()
    """Drafted tokens run after the request's last token (its last ``len(draft)`` rows), to verify."""
    end: int = field(init=False)
    """The history its rows see: computed tokens before the step plus ``num_new`` (fixed when
    scheduled; after a verification the request has computed fewer -- the rejected drafts')."""

    def __post_init__(self) -> None:
        self.end = self.request.num_computed_tokens + self.num_new

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the known tokens (so its last row is sampled)."""
        return self.start + self.num_new == self.request.num_tokens + len(self.draft)

    @property
    def num_sampled(self) -> int:
        """Rows sampled: the last one of a chunk that reaches the end, and every drafted one."""
        return 1 + len(self.draft) if self.samples else 0

    def tokens(self) -> list[int]:
        """The input ids of this step's rows."""
        known = self.request.tokens_at(self.start, self.num_new - len(self.draft))
        return known + list(self.draft) if self.draft else known


class RequestQueue:
    """Waiting requests in order; O(1) removal anywhere (a follower leaves with its leader) and at the
    head (a retracted request goes back in front)."""

    def __init__(self) -> None:
        self._items: OrderedDict[Request, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def head(self) -> Request:
        return next(iter(self._items))

    def append(self, req: Request) -> None:
        self._items[req] = None

    def appendleft(self, req: Request) -> None:
        self._items[req] = None
        self._items.move_to_end(req, last=False)

    def remove(self, req: Request) -> None:
        del self._items[req]


class Scheduler:
    def __init__(self, placement: KVPlacement, max_num_batched_tokens: int, max_num_seqs: int = 256,
                 ever_admits: Callable[[Request], bool] | None = None,
                 admission: AdmissionSettings = AdmissionSettings(), prefix_sharing: bool = True,
                 drafter: "Drafter | None" = None, prefix_cache: bool = False) -> None:
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: expected >= 1, got {max_num_batched_tokens}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: expected >= 1, got {max_num_seqs}")
        self.placement = placement
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting = RequestQueue()
        self.running: list[Request] = []
        """Admission order (the youngest last)."""
        self.ever_admits = ever_admits
        """Whether a request can ever run; default: in the current layout's empty pools. An engine
        that may switch layouts (``auto``) accepts what any reachable layout holds."""
        self.estimate = GrowthEstimate(admission)
        self.prefix_sharing = prefix_sharing
        self._waiting_by_prompt: dict[tuple[int, ...], OrderedDict[Request, None]] = {}
        self._live_by_prompt: dict[tuple[int, ...], list[Request]] = {}
        """Running samples whose page tables hold their prompt's KV (what a late sample attaches to)."""
        self._admissions = 0
        self.copies: list[PageCopy] = []
        """This step's copy-on-write page copies (run after the step's forward wrote the source)."""
        self.retracted: list[Request] = []
        """Requests this step's schedule retracted (their device page-table rows must go)."""
        self.prefix_hit_tokens = 0
        """Tokens of KV this step's admissions and forks took from a sample of the same prompt."""
        self.prefix_sources: list[tuple[Request, Request, int]] = []
        """This step's (taker, sample it took from, tokens): what else follows the KV (routing records)."""
        self.drafter = drafter
        """Proposes tokens for decoding requests to verify (None: no speculation)."""
        self.drafts: dict[Request, tuple[int, ...]] = {}
        """This step's drafts, per decoding request."""
        self.accepted = 0
        """Drafted tokens this step's verification kept."""
        self.accepted_sq = 0
        """Sum over this step's verified requests of the square of what each kept (its spread)."""
        self.written = 0
        """Tokens this step appended to its requests (sampled, drafts kept included)."""
        self.by_source: dict[str, list[int]] = {}
        """This step's verifications per draft source: [verified requests, drafted tokens, kept]."""
        self.by_position: list[list[int]] = []
        """This step's verifications per drafted position j: [drafts whose tokens before j were all kept
        and that drafted a token j, of those the ones whose token j was kept]."""
        self.draft_cap = 0
        """Most drafted tokens per request this step (set before each step from the driver's control)."""
        self.cache = (PrefixCache(placement.managers, placement.page_size, placement.ownership)
                      if prefix_cache and prefix_sharing else None)
        """Finished requests' pages, for later requests that start with the same tokens (None: off)."""
        self.cached_tokens = 0
        """Tokens of KV this step's admissions took from the prefix cache."""

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def can_ever_admit(self, request: Request) -> bool:
        if self.ever_admits is not None:
            return self.ever_admits(request)
        return self.placement.can_ever_admit(request)

    def add(self, request: Request) -> None:
        if not self.can_ever_admit(request):
            raise ValueError(f"num_pages: request {request.request_id} needs "
                             f"{request.pages_needed(self.placement.page_size)} pages, more than the "
                             f"{self.placement.layout} pools hold ({[m.num_pages for m in self.placement.managers]})")
        self._queue(request)

    def _queue(self, request: Request, front: bool = False) -> None:
        request.status = RequestStatus.WAITING
        (self.waiting.appendleft if front else self.waiting.append)(request)
        if self.prefix_sharing:
            self._waiting_by_prompt.setdefault(request.prefix_key, OrderedDict())[request] = None

    def _unqueue(self, request: Request) -> None:
        self.waiting.remove(request)
        if self.prefix_sharing:
            same = self._waiting_by_prompt[request.prefix_key]
            del same[request]
            if not same:
                del self._waiting_by_prompt[request.prefix_key]

    # ---- expected growth ---------------------------------------------------------------------
    def expected_total(self, req: Request) -> int:
        """Tokens ``req`` is expected to reach (its cap under worst-case admission)."""
        return self.estimate.expected_total(req.num_tokens, req.max_total_tokens)

    def _expected_pages(self, req: Request, have_pages: int, layout: Layout | None = None) -> list[int]:
        """[T] pages each rank is expected to still hand out to ``req`` beyond its first ``have_pages``
        (in ``layout``, by default the current one)."""
        want = num_pages_for(self.expected_total(req), self.placement.page_size)
        return self.placement.pages_between(have_pages, want, req.owner, layout)

    def pages_promised(self, layout: Layout | None = None) -> list[int]:
        """[T] pages the running requests are expected to still take on each rank (in ``layout``, by
        default the current one); a follower's prompt pages are its leader's."""
        total = [0] * self.placement.world_size
        ps = self.placement.page_size
        for req in self.running:
            have = req.num_prompt_tokens // ps if req.fork_of is not None else req.num_logical_pages
            total = [a + b for a, b in zip(total, self._expected_pages(req, have, layout))]
        return total

    # ---- schedule ----------------------------------------------------------------------------
    def clear_cache(self) -> None:
        """Forget the cached pages (their KV no longer means what it meant: new weights, or a layout
        that places histories differently)."""
        if self.cache is not None:
            self.cache.clear()

    def schedule(self) -> list[ScheduledSeq]:
        self.copies, self.retracted, self.prefix_hit_tokens, self.prefix_sources = [], [], 0, []
        self.cached_tokens = 0
        if self.cache is not None:
            self.cache.clock += 1
        self.drafts, self.accepted, self.accepted_sq, self.written = {}, 0, 0, 0
        self.by_source, self.by_position = {}, []
        self.estimate.stepped()
        plan = self._running_rows()
        if self.drafter is not None and self.draft_cap > 0:
            plan = self._with_drafts(plan, self.max_num_batched_tokens - sum(n for _, n in plan))
        plan = self._fit(plan)
        budget = self.max_num_batched_tokens - sum(n for _, n in plan)
        out = [self._take(req, n) for req, n in plan]
        room = None  # pages free beyond the running requests' promises: counted only if someone may join
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            if room is None:
                room = [f - p for f, p in zip(self.placement.pages_free, self.pages_promised())]
            if self.retracted and self.waiting.head() in self.retracted:
                break  # what this step just gave back is not taken again in the same step
            seq = self._admit(self.waiting.head(), room, budget)
            if seq is None:
                break  # FIFO: later requests wait behind the head so long prompts are not starved
            out.append(seq)
            budget -= seq.num_new
        return out

    def _running_rows(self) -> list[tuple[Request, int]]:
        """The running requests' rows this step: decode first, then prefill chunks, within the budget.
        Drafts are not in it: only ``schedule`` asks the drafter (asking changes the drafter's index,
        and ``pressure`` runs on rank 0 alone -- every replica must ask it the same questions)."""
        budget = self.max_num_batched_tokens
        plan: list[tuple[Request, int]] = []
        decoding = [r for r in self.running if r.fork_of is None and not r.in_prefill]
        prefilling = [r for r in self.running if r.fork_of is None and r.in_prefill]
        for req in decoding + prefilling:
            if budget == 0:
                break
            n = min(req.num_uncomputed_tokens, budget)
            plan.append((req, n))
            budget -= n
        return plan

    def _with_drafts(self, plan: list[tuple[Request, int]], budget: int) -> list[tuple[Request, int]]:
        """The decode rows with the drafts of the requests the drafter has one for, within the step's
        budget and each request's cap (the last drafted position stays below its reservation)."""
        out = []
        for req, n in plan:
            if budget > 0 and n == 1 and not req.in_prefill and not req.forks:
                room = min(budget, self.draft_cap, req.max_total_tokens - req.num_tokens - 1)
                draft = self.drafter.propose(req, room) if room > 0 else ()
                if draft:
                    self.drafts[req] = draft
                    n += len(draft)
                    budget -= len(draft)
            out.append((req, n))
        return out

    def pressure(self) -> tuple[list[int], list[Request]]:
        """Before a step, without changing anything: [T] pages the running requests' rows would lack on
        each rank, and the requests ``schedule`` would retract for them (youngest first; estimated
        from the pages only they hold). ([0] * T, []) when the step fits. Drafts are left out: a
        step drops its drafts before it retracts, so they never make pressure."""
        if self._surely_fits():
            return [0] * self.placement.world_size, []
        plan = self._running_rows()
        need = self._step_need(plan)
        free = self.placement.pages_free
        short = [max(0, n - f) for n, f in zip(need, free)]
        if not any(short):
            return short, []
        victims = []
        for v in sorted((r for r in self.running if r.fork_of is None), key=lambda r: -r.admitted_at)[:-1]:
            victims.append(v)
            for rank, table in enumerate(v.rank_pages):
                m = self.placement.managers[rank]
                free[rank] += sum(1 for p in table if p >= 0 and m.refs(p) == 1)
            need = self._step_need([(r, n) for r, n in plan if r not in victims])
            if all(n <= f for n, f in zip(need, free)):
                break
        return short, victims

    def _surely_fits(self) -> bool:
        """Whether every rank has more free pages than any step of the running batch could take: a
        request's rows need at most ceil(rows / page_size) new pages on a rank and a leader one copied
        page per follower, so ceil(budget / page_size) + 2 x running bounds a step's need. O(1); the
        exact per-request count runs only when the pools are nearly full."""
        bound = -(-self.max_num_batched_tokens // self.placement.page_size) + 2 * len(self.running)
        return min(self.placement.pages_free) >= bound

    def _step_need(self, plan: list[tuple[Request, int]]) -> list[int]:
        """[T] pages this step's rows need (growth, and the followers' copies of a last prompt page)."""
        p = self.placement
        need = [0] * p.world_size
        for req, n in plan:
            need = [a + b for a, b in zip(need, p.growth(req, req.num_computed_tokens + n))]
            if req.forks and req.num_computed_tokens + n == req.num_tokens and req.num_prompt_tokens % p.page_size:
                last = req.num_prompt_tokens // p.page_size  # the partly filled page each follower copies
                copy = p.pages_between(last, last + 1, req.owner)
                need = [a + len(req.forks) * c for a, c in zip(need, copy)]
        return need

    def _fit(self, plan: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """Retract the youngest running requests until this step's pages are free on every rank."""
        if self._surely_fits():
            return plan
        while True:
            need = self._step_need(plan)
            if all(n <= f for n, f in zip(need, self.placement.pages_free)):
                return plan
            if self.drafts:  # speculation never costs a retraction: drop the drafts first
                plan = [(r, n - len(self.drafts.get(r, ()))) for r, n in plan]
                self.drafts = {}
                continue
            victims = [r for r in self.running if r.fork_of is None]
            if len(victims) <= 1:
                raise RuntimeError(f"schedule: the step needs {need} KV pages per rank, "
                                   f"{self.placement.pages_free} are free and nothing is left to retract")
            victim = max(victims, key=lambda r: r.admitted_at)
            gone = {victim, *victim.forks}
            self._retract(victim)
            plan = [(r, n) for r, n in plan if r not in gone]

    def _retract(self, req: Request) -> None:
        """Take the request's pages back; it keeps its tokens and waits at the queue head."""
        for f in reversed(req.forks):  # followers that never started go back behind their leader
            self._drop_running(f)
            f.fork_of = None
            self._queue(f, front=True)
        req.forks = []
        self._drop_running(req)
        req.num_computed_tokens = 0
        req.num_retractions += 1
        self._queue(req, front=True)
        self.retracted.append(req)
        self.estimate.retracted()

    def _drop_running(self, req: Request) -> None:
        self.placement.release(req)
        self.running.remove(req)
        if self.prefix_sharing and req.fork_of is None:
            live = self._live_by_prompt.get(req.prefix_key, [])
            if req in live:
                live.remove(req)
                if not live:
                    del self._live_by_prompt[req.prefix_key]

    def _make_live(self, req: Request) -> None:
        if self.prefix_sharing:
            self._live_by_prompt.setdefault(req.prefix_key, []).append(req)

    def _take(self, req: Request, n: int) -> ScheduledSeq:
        """Grow the page tables so positions [0, computed + n) have pages; a chunk that completes a
        leader's prompt forks its followers."""
        self.placement.grow(req, req.num_computed_tokens + n)
        seq = ScheduledSeq(req, n, draft=self.drafts.get(req, ()))
        if req.forks and req.num_computed_tokens + n == req.num_tokens:
            for f in req.forks:
                self.copies += self.placement.fork(req, f, req.num_prompt_tokens)
                f.fork_of = None
                self._make_live(f)
                self.prefix_hit_tokens += req.num_prompt_tokens
                self.prefix_sources.append((f, req, req.num_prompt_tokens))
            seq.forks, req.forks = req.forks, []
        return seq

    def _admit(self, req: Request, room: list[int], budget: int) -> ScheduledSeq | None:
        """Admit the queue head (and the fresh samples of its prompt) if their expected pages fit
        ``room`` (updated in place); None leaves it waiting."""
        p, ps = self.placement, self.placement.page_size
        prefix, shared = self._prefix_for(req)
        owners = [prefix.owner] if prefix is not None else p.owners_by_balance()
        cached_owner, chain = self._cached_for(req, shared, owners)
        revived = [0] * p.world_size
        if chain:  # the cache holds more of its history than a live sample does
            prefix, shared, owners = None, len(chain), [cached_owner]
            revived = self.cache.reclaimable_in(chain)  # counted free in ``room`` until taken
        for owner in owners:
            req.owner = owner
            need = [n + k for n, k in zip(self._expected_pages(req, shared), revived)]
            if all(n <= r for n, r in zip(need, room)):
                break
        else:
            return None
        self._unqueue(req)
        self._start(req, owner, prefix, shared if prefix is not None else 0)
        if chain:
            self.cache.take(req, chain)
            self.cached_tokens += shared * ps
        room[:] = [r - n for r, n in zip(room, need)]
        if shared:
            req.num_computed_tokens = shared * ps
            self.prefix_hit_tokens += shared * ps
            if prefix is not None:  # a live sample (the cache's pages have no source left to follow)
                self.prefix_sources.append((req, prefix, shared * ps))
        elif self.prefix_sharing and req.num_output_tokens == 0:
            self._take_followers(req, room)
        self._make_live(req)
        return self._take(req, min(req.num_uncomputed_tokens, budget))

    def _start(self, req: Request, owner: int, prefix: Request | None = None, shared: int = 0) -> None:
        self.placement.start(req, owner, prefix, shared)
        req.status = RequestStatus.RUNNING
        req.admitted_at = self._admissions
        self._admissions += 1
        self.running.append(req)

    def _prefix_for(self, req: Request) -> tuple[Request | None, int]:
        """A live sample of the same prompt and how many of its full prompt pages ``req`` can take
        (at least one position is left to compute: its last row gives ``req`` its next token)."""
        if not self.prefix_sharing:
            return None, 0
        ps = self.placement.page_size
        best, most = None, 0
        for m in self._live_by_prompt.get(req.prefix_key, []):
            n = min(req.num_prompt_tokens // ps, m.num_computed_tokens // ps, (req.num_tokens - 1) // ps)
            if n > most:
                best, most = m, n
        return best, most

    def _cached_for(self, req: Request, live_pages: int, owners: list[int]) -> tuple[int | None, list]:
        """A cached chain of ``req``'s first full pages longer than ``live_pages`` (what a live sample
        gives), leaving at least one position to compute, and its owner; (None, []) otherwise."""
        if self.cache is None:
            return None, []
        most = (req.num_tokens - 1) // self.placement.page_size
        if most <= live_pages:
            return None, []
        owner, chain = self.cache.match(req.token_ids, most, owners)
        return (owner, chain) if len(chain) > live_pages else (None, [])

    def _take_followers(self, leader: Request, room: list[int]) -> None:
        """Admit the waiting samples of the leader's prompt that have not started, while they fit."""
        same = self._waiting_by_prompt.get(leader.prefix_key)
        shared = leader.num_prompt_tokens // self.placement.page_size
        for f in list(same or ()):
            if len(self.running) >= self.max_num_seqs:
                break
            if f.num_output_tokens:  # a retracted sample: it prefills what it had, then attaches
                continue
            f.owner = leader.owner
            need = self._expected_pages(f, shared)
            if not all(n <= r for n, r in zip(need, room)):
                break
            self._unqueue(f)
            self._start(f, leader.owner)
            f.fork_of = leader
            leader.forks.append(f)
            room[:] = [r - n for r, n in zip(room, need)]

    # ---- postprocess -------------------------------------------------------------------------
    def postprocess(self, scheduled: list[ScheduledSeq], tokens: Sequence[int],
                    logprobs: Sequence[float]) -> list[Request]:
        """tokens / logprobs: [R] (host) for the scheduled seqs that sample and their forks, in order.
        Returns the finished."""
        finished = []
        k = 0
        sampled, sampled_logprobs = tokens, logprobs
        for s in scheduled:
            samples = s.samples
            if s.draft:
                k = self._verify(s, sampled, sampled_logprobs, k, finished)
                continue
            s.request.num_computed_tokens += s.num_new
            if not samples:
                continue
            for req in (s.request, *s.forks):
                req.num_computed_tokens = s.request.num_computed_tokens
                req.append_token(sampled[k], sampled_logprobs[k])
                k += 1
                self.written += 1
                if self.drafter is not None:
                    self.drafter.observe(req, 0, 0)
                if req.finish_reason is not None:
                    self.finish(req, req.finish_reason)
                    finished.append(req)
        return finished

    def postprocess_provisional(self, scheduled: list[ScheduledSeq], tokens: Sequence[int],
                                logprobs: Sequence[float]) -> None:
        """A step inside a token window (engine/token_window.py): every scheduled one-row decode
        computed its row and holds ``tokens[i]`` [S] provisionally; nothing finishes until ``settle``."""
        for s, token, logprob in zip(scheduled, tokens, logprobs):
            s.request.num_computed_tokens += s.num_new
            s.request.append_provisional(token, logprob)
        self.written += len(scheduled)

    def settle(self, scheduled: list[ScheduledSeq], tokens: Sequence[Sequence[int]],
               logprobs: Sequence[Sequence[float]]) -> list[Request]:
        """A token window closes: tokens / logprobs [K][S] (host) are what each of the window's K steps
        sampled for each scheduled request (every replica holds them now). Each request's K
        provisional tokens become the real ones under the usual stop rule; returns the finished."""
        finished = []
        for s, row_tokens, row_logprobs in zip(scheduled, zip(*tokens), zip(*logprobs)):
            req = s.request
            req.settle(row_tokens, row_logprobs)
            if self.drafter is not None:
                self.drafter.observe(req, 0, 0)
            if req.finish_reason is not None:
                req.num_computed_tokens = min(req.num_computed_tokens, max(req.num_tokens - 1, 0))
                self.finish(req, req.finish_reason)
                finished.append(req)
        return finished

    def _verify(self, s: ScheduledSeq, tokens: list[int], logprobs: list[float], k: int,
                finished: list[Request]) -> int:
        """A drafted decode: tokens[k : k + 1 + len(draft)] are what each row sampled. Keep the sampled
        tokens while each equals the draft it follows, and the first that differs (or the bonus one
        after a fully accepted draft); the KV of the rows whose input was kept is valid. Returns the
        next index into ``tokens``."""
        req, draft = s.request, s.draft
        start = req.num_computed_tokens
        kept = accepted = 0
        for j in range(len(draft) + 1):
            token = tokens[k + j]
            req.append_token(token, logprobs[k + j])
            kept += 1
            matches = j < len(draft) and token == draft[j]
            accepted += matches
            if req.finish_reason is not None or not matches:
                break
        req.num_computed_tokens = start + kept  # the last token and the accepted drafts: their rows' KV
        self.drafter.observe(req, len(draft), accepted)
        credit(self.by_source, self.drafter.source(req), len(draft), accepted)
        for j in range(min(len(draft), accepted + 1)):  # per position reached with every earlier draft kept
            if j == len(self.by_position):
                self.by_position.append([0, 0])
            self.by_position[j][0] += 1
            self.by_position[j][1] += accepted > j
        self.accepted += accepted
        self.accepted_sq += accepted * accepted
        self.written += kept
        if req.finish_reason is not None:
            self.finish(req, req.finish_reason)
            finished.append(req)
        return k + len(draft) + 1

    def finish(self, req: Request, reason: str) -> None:
        """Retire a request: drop its page references."""
        if self.drafter is not None:
            self.drafter.finished(req)
        if req.status is RequestStatus.RUNNING:
            for f in list(req.forks):
                self.finish(f, reason)
            req.forks = []
            if self.cache is not None and req.fork_of is None:
                self.cache.insert(req)  # before its own references go
            self._drop_running(req)
        else:
            self._unqueue(req)
        req.fork_of = None
        req.finish_reason = reason
        req.status = RequestStatus.FINISHED

    def abort_all(self) -> list[Request]:
        aborted = list(self.running) + list(self.waiting)
        for req in aborted:
            if not req.is_finished:
                self.finish(req, "abort")
        return aborted
