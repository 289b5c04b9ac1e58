"""Drafts without a draft model: the next tokens a sample is likely to write, from text it has seen.

RL rollouts write the same thing many times: the n samples of a GRPO group answer one prompt, a
prompt pool or a new epoch asks it again, and a sample repeats its own prompt and its own earlier
lines. ``SuffixDrafter`` keeps, per prompt, an n-gram index over those token sequences and proposes
what followed the longest suffix of the sample's tokens that occurred before:

* the live samples of the same prompt (its siblings in the group), as they are written;
* the prompt's responses from earlier calls: at most ``history_per_prompt`` finished sequences,
  the oldest dropped first (its n-grams counted out), for at most ``max_prompts`` prompts and
  ``max_tokens`` tokens held over all of them (the least recently drafted prompts dropped: a
  token costs 0.4 KB of n-gram tables on the recipe's chains, 1.6 KB on text where every n-gram is
  new, measured with tracemalloc, so the default 2^19 holds an index to 0.2-0.8 GB per rank).
  They are kept across weight updates -- one RL step moves the policy little, and a stale entry
  costs only a rejected draft; the most recent occurrence of an n-gram wins, so fresher text leads;
* the sample's own prompt and response so far.

For each n-gram it keeps how often each token followed it. A draft is built a token at a time:
the most frequent follower of the longest n-gram ending the text (drafted tokens included), while
the product of their frequencies (the draft's estimated chance to be kept whole) stays at or above
``min_confidence`` -- where the group's samples agree, drafts run long; where they diverge, none is
proposed and no row is spent. A draft token needs a match of at least ``min_match`` tokens: what
followed a single token anywhere predicts little (recorded groups of the GRPO recipe's trained
policy, replayed offline -- verification is seed-exact, so a draft's kept prefix is its common
prefix with the recorded continuation: unigram fallbacks kept 0.47 of their drafted tokens overall,
with ``min_match=2`` 0.59, for the same number of target steps).

Why an n-gram table and not a suffix tree: the matches that pay are short (a few tokens of context
predict the next few), the index must grow by one token per sample per step at O(max_ngram) cost,
and every rank's scheduler replica must build exactly the same one from the same tokens -- a dict
of tuples is all three. The draft length also follows the match length (``tokens_per_match`` per
matched token) and the request's last verification (after a rejection, at most twice what was
accepted plus one; after a full acceptance it doubles, up to ``max_draft``).

Tokens are held as they come and indexed when a draft is next asked of their prompt: under
``speculation="auto"`` with drafts off (a wide batch) the index costs nothing.

Each draft is credited to where its first token was last seen (``DRAFT_SOURCES``: the group, an
earlier call's response, the sample itself, the prompt), so acceptance is reported per source.

``Drafter`` is the seam: the model's own MTP module drafts through the same calls (engine/mtp_drafter.py).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from splash_rollout.engine.request import Request


class Drafter(Protocol):
    """What the scheduler asks of a draft source. Every call is made in the same order on every
    rank's replica, with the same arguments, so every replica proposes the same drafts."""

    def propose(self, request: Request, max_tokens: int) -> tuple[int, ...]:
        """Up to ``max_tokens`` token ids to verify after ``request``'s last token (may be empty)."""

    def observe(self, request: Request, drafted: int, accepted: int) -> None:
        """``request`` appended tokens this step; ``drafted`` of them were proposed, ``accepted`` kept."""

    def finished(self, request: Request) -> None:
        """``request`` will write no more: its tokens join its prompt's history."""

    def source(self, request: Request) -> str:
        """Where the last draft proposed for ``request`` came from: one of ``DRAFT_SOURCES``."""

    def new_call(self) -> None:
        """A generate call starts (its samples are a new group)."""


DRAFT_SOURCES = ("group", "history", "own", "prompt", "mtp")
"""Where a draft came from: for the n-gram drafter, where its first token was last seen -- another
sample of this call for the same prompt (``group``), a response from an earlier call (``history``),
the sample itself (``own``), its prompt; ``mtp``: the model's MTP module (engine/mtp_drafter.py)."""


def next_cap(max_draft: int, drafted: int, accepted: int) -> int:
    """A request's draft cap after a verification: after a full acceptance it doubles, after a
    rejection twice what was accepted plus one; never above ``max_draft``."""
    return min(max_draft, 2 * drafted if accepted == drafted else max(1, 2 * accepted + 1))


def credit(table: dict[str, list[int]], source: str, drafted: int, kept: int) -> None:
    """Count one verification in ``table`` (source -> [verifications, drafted tokens, kept])."""
    counts = table.setdefault(source, [0, 0, 0])
    counts[0], counts[1], counts[2] = counts[0] + 1, counts[1] + drafted, counts[2] + kept


@dataclass
class _Sequence:
    tokens: list[int]
    """Prompt and response so far."""
    indexed: int
    """Leading tokens whose n-grams ending just before them are in the index."""
    writer: int = -1
    """Its id in the index's ``sequences`` (-1: the prompt)."""
    start: int = 0
    """Where its own tokens begin (the prompt's length for a response): what ``_unindex`` removes."""
    call: int = 0
    """The drafter's call counter when it started."""


@dataclass
class _PromptIndex:
    """One prompt's sequences and the n-grams that occur in them."""

    sequences: dict[int, _Sequence] = field(default_factory=dict)
    """Sequence id (the request id while live) -> its tokens."""
    history: list[int] = field(default_factory=list)
    """Ids of finished sequences kept, oldest first."""
    followers: dict[tuple[int, ...], dict[int, int]] = field(default_factory=dict)
    """n-gram -> {token that followed it: times}. The prompt's own n-grams are counted once, not
    once per sample."""
    prompt: _Sequence | None = None
    """The prompt (its n-grams counted once, not once per sample)."""
    pending: dict[int, _Sequence] = field(default_factory=dict)
    """Sequences (and the prompt, id -1) with tokens not yet indexed: indexed when a draft is next
    asked of this prompt, so a call that never drafts (``auto`` keeping drafts off) never indexes."""
    last_writer: dict[tuple[int, ...], int] = field(default_factory=dict)
    """n-gram + (follower,) -> the sequence id that wrote it last (-1: the prompt)."""
    tokens: int = 0
    """Tokens held (the prompt once, then every sequence's own), indexed or pending."""


@dataclass
class DraftStats:
    """Totals since the engine started (the step log counts per step)."""

    proposed: int = 0
    """Drafted tokens verified."""
    accepted: int = 0
    """Of those, kept."""
    rejections: int = 0
    """Verifications that rejected a drafted token (the rest kept every one)."""
    asked: int = 0
    """``propose`` calls."""
    drafted_requests: int = 0
    """``propose`` calls that returned a draft."""
    by_source: dict[str, list[int]] = field(default_factory=lambda: {src: [0, 0, 0] for src in DRAFT_SOURCES})
    """Source -> [verifications, drafted tokens verified, kept] of the drafts that started there."""

    def verified(self, source: str, drafted: int, accepted: int) -> None:
        """Count one verification of ``drafted`` tokens from ``source``, ``accepted`` of them kept."""
        self.proposed += drafted
        self.accepted += accepted
        self.rejections += accepted < drafted
        credit(self.by_source, source, drafted, accepted)


class SuffixDrafter:
    def __init__(self, max_draft: int = 8, max_ngram: int = 4, tokens_per_match: float = 2.0,
                 min_confidence: float = 0.3, history_per_prompt: int = 64, max_prompts: int = 4096,
                 min_match: int = 2, max_tokens: int = 1 << 19) -> None:
        if max_draft < 1 or not 1 <= min_match <= max_ngram:
            raise ValueError(f"SuffixDrafter: expected max_draft >= 1 and 1 <= min_match <= max_ngram, got "
                             f"{max_draft}, {min_match}, {max_ngram}")
        self.max_draft, self.max_ngram, self.tokens_per_match = max_draft, max_ngram, tokens_per_match
        self.min_match = min_match
        self.min_confidence = min_confidence
        self.history_per_prompt, self.max_prompts, self.max_tokens = history_per_prompt, max_prompts, max_tokens
        self._tokens = 0
        """Tokens indexed over every prompt: above ``max_tokens`` the least recently drafted prompts go."""
        self._prompts: OrderedDict[tuple[int, ...], _PromptIndex] = OrderedDict()
        self._cap: dict[int, int] = {}
        """request id -> its draft cap after its last verification."""
        self._source: dict[int, str] = {}
        """request id -> where its last draft started."""
        self.call = 0
        """Calls started (``new_call``): a sequence of an earlier call is ``history``."""
        self.stats = DraftStats()

    def new_call(self) -> None:
        """A generate call starts: sequences written from now on are this call's group."""
        self.call += 1

    # ---- the Drafter calls ------------------------------------------------------------------------
    def propose(self, request: Request, max_tokens: int) -> tuple[int, ...]:
        limit = min(max_tokens, self._cap.get(request.request_id, self.max_draft))
        if limit <= 0:
            return ()
        self.stats.asked += 1
        index, seq = self._sequence(request)
        self._catch_up(index)
        tokens, draft, chance, k = seq.tokens, [], 1.0, limit
        while len(draft) < k:
            text = tokens[-self.max_ngram:] + draft if draft else tokens
            for n in range(min(self.max_ngram, len(text)), self.min_match - 1, -1):
                followers = index.followers.get(tuple(text[-n:]))
                if followers:
                    break
            else:
                break
            token, times = max(followers.items(), key=lambda item: item[1])  # ties: the first seen
            chance *= times / (sum(followers.values()) + 1)  # one unseen follower: a single sighting is 1/2
            if chance < self.min_confidence:
                break
            if not draft:  # the first match sets how far the draft may run, and names its source
                k = min(limit, max(1, int(self.tokens_per_match * n)))
                self._source[request.request_id] = self._source_of(index, request, text[-n:] + [token])
            draft.append(token)
        if draft:
            self.stats.drafted_requests += 1
        return tuple(draft)

    def source(self, request: Request) -> str:
        return self._source.get(request.request_id, "own")

    def observe(self, request: Request, drafted: int, accepted: int) -> None:
        index, seq = self._sequence(request)
        new = request.output_ids[len(seq.tokens) - request.num_prompt_tokens:]
        if new:
            seq.tokens.extend(new)
            index.pending[seq.writer] = seq
            self._hold(index, len(new))
        if drafted:
            self.stats.verified(self.source(request), drafted, accepted)
            self._cap[request.request_id] = next_cap(self.max_draft, drafted, accepted)

    def finished(self, request: Request) -> None:
        self._cap.pop(request.request_id, None)
        self._source.pop(request.request_id, None)
        index = self._prompts.get(request.prefix_key)
        if index is None or request.request_id not in index.sequences:
            return
        index.history.append(request.request_id)
        if len(index.history) > self.history_per_prompt:
            dropped = index.sequences.pop(index.history.pop(0))
            index.pending.pop(dropped.writer, None)
            self._unindex(index, dropped)
            self._hold(index, -(len(dropped.tokens) - dropped.start))

    # ---- the index --------------------------------------------------------------------------------
    def _sequence(self, request: Request) -> tuple[_PromptIndex, _Sequence]:
        key = request.prefix_key
        index = self._prompts.get(key)
        if index is None:
            index = self._prompts[key] = _PromptIndex()
        else:
            self._prompts.move_to_end(key)
        seq = index.sequences.get(request.request_id)
        if seq is None:
            if index.prompt is None:
                index.prompt = index.pending[-1] = _Sequence(list(request.prompt_ids), 0)
                self._hold(index, request.num_prompt_tokens)
            p = request.num_prompt_tokens
            seq = index.sequences[request.request_id] = _Sequence(list(request.token_ids), p, request.request_id, p,
                                                                  self.call)
            index.pending[seq.writer] = seq
            self._hold(index, len(seq.tokens) - p)
        while len(self._prompts) > 1 and (len(self._prompts) > self.max_prompts or self._tokens > self.max_tokens):
            self._tokens -= self._prompts.popitem(last=False)[1].tokens  # the least recently drafted prompt
        return index, seq

    def _hold(self, index: _PromptIndex, tokens: int) -> None:
        index.tokens += tokens
        self._tokens += tokens

    def _catch_up(self, index: _PromptIndex) -> None:
        """Index every token of this prompt's sequences seen since its last draft (prompt first)."""
        for seq in index.pending.values():
            self._index(index, seq)
        index.pending.clear()

    def _source_of(self, index: _PromptIndex, request: Request, ngram_and_token: list[int]) -> str:
        writer = index.last_writer.get(tuple(ngram_and_token), -1)
        if writer == -1:
            return "prompt"
        if writer == request.request_id:
            return "own"
        seq = index.sequences.get(writer)
        return "group" if seq is not None and seq.call == self.call else "history"

    def _index(self, index: _PromptIndex, seq: _Sequence) -> None:
        """Enter the n-grams ending just before each token not yet indexed (its continuation is known)."""
        tokens, followers, top = seq.tokens, index.followers, self.max_ngram
        writers, writer = index.last_writer, seq.writer
        for pos in range(max(seq.indexed, 1), len(tokens)):
            token = tokens[pos]
            for n in range(1, min(top, pos) + 1):
                ngram = tuple(tokens[pos - n: pos])
                counts = followers.setdefault(ngram, {})
                counts[token] = counts.get(token, 0) + 1
                if n >= self.min_match:
                    writers[ngram + (token,)] = writer
        seq.indexed = len(tokens)

    def _unindex(self, index: _PromptIndex, seq: _Sequence) -> None:
        """Take a dropped sequence's n-grams out of the counts (what ``_index`` entered for it)."""
        tokens, followers, writers, top = seq.tokens, index.followers, index.last_writer, self.max_ngram
        for pos in range(max(seq.start, 1), seq.indexed):
            token = tokens[pos]
            for n in range(1, min(top, pos) + 1):
                ngram = tuple(tokens[pos - n: pos])
                counts = followers[ngram]
                counts[token] -= 1
                if not counts[token]:
                    del counts[token]
                    if not counts:
                        del followers[ngram]
                if n >= self.min_match and writers.get(ngram + (token,)) == seq.writer:
                    del writers[ngram + (token,)]
