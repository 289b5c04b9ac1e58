"""Drafts without a draft model: the next tokens a sample is likely to write, from text it has seen.

RL rollouts write the same thing many times: the n samples of a GRPO group answer one prompt, a
prompt pool or a new epoch asks it again, and a sample repeats its own prompt and its own earlier
lines. ``SuffixDrafter`` keeps, per prompt, an n-gram index over those token sequences and proposes
what followed the longest suffix of the sample's tokens that occurred before:

* the live samples of the same prompt (its siblings in the group), as they are written;
* the prompt's responses from earlier calls: at most ``history_per_prompt`` finished sequences,
  the oldest dropped first, for at most ``max_prompts`` prompts (least recently drafted dropped).
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

``Drafter`` is the seam: a model draft (MTP heads) implements the same three calls.
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


@dataclass
class _Sequence:
    tokens: list[int]
    """Prompt and response so far."""
    indexed: int
    """Leading tokens whose n-grams ending just before them are in the index."""


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
    prompt: list[int] | None = None
    """The prompt, once its n-grams are counted."""


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


class SuffixDrafter:
    def __init__(self, max_draft: int = 8, max_ngram: int = 4, tokens_per_match: float = 2.0,
                 min_confidence: float = 0.3, history_per_prompt: int = 64, max_prompts: int = 4096,
                 min_match: int = 2) -> None:
        if max_draft < 1 or not 1 <= min_match <= max_ngram:
            raise ValueError(f"SuffixDrafter: expected max_draft >= 1 and 1 <= min_match <= max_ngram, got "
                             f"{max_draft}, {min_match}, {max_ngram}")
        self.max_draft, self.max_ngram, self.tokens_per_match = max_draft, max_ngram, tokens_per_match
        self.min_match = min_match
        self.min_confidence = min_confidence
        self.history_per_prompt, self.max_prompts = history_per_prompt, max_prompts
        self._prompts: OrderedDict[tuple[int, ...], _PromptIndex] = OrderedDict()
        self._cap: dict[int, int] = {}
        """request id -> its draft cap after its last verification."""
        self.stats = DraftStats()

    # ---- the Drafter calls ------------------------------------------------------------------------
    def propose(self, request: Request, max_tokens: int) -> tuple[int, ...]:
        limit = min(max_tokens, self._cap.get(request.request_id, self.max_draft))
        if limit <= 0:
            return ()
        self.stats.asked += 1
        index, seq = self._sequence(request)
        tokens, draft, chance, k = seq.tokens, [], 1.0, limit
        while len(draft) < k:
            text = tokens[-self.max_ngram:] + draft if draft else tokens
            for n in range(min(self.max_ngram, len(text)), self.min_match - 1, -1):
                followers = index.followers.get(tuple(text[-n:]))
                if followers:
                    break
            else:
                break
            if not draft:  # the first match sets how far the draft may run
                k = min(limit, max(1, int(self.tokens_per_match * n)))
            token, times = max(followers.items(), key=lambda item: item[1])  # ties: the first seen
            chance *= times / (sum(followers.values()) + 1)  # one unseen follower: a single sighting is 1/2
            if chance < self.min_confidence:
                break
            draft.append(token)
        if draft:
            self.stats.drafted_requests += 1
        return tuple(draft)

    def observe(self, request: Request, drafted: int, accepted: int) -> None:
        index, seq = self._sequence(request)
        seq.tokens.extend(request.output_ids[len(seq.tokens) - request.num_prompt_tokens:])
        self._index(index, seq)
        if drafted:
            self.stats.proposed += drafted
            self.stats.accepted += accepted
            self.stats.rejections += accepted < drafted
            self._cap[request.request_id] = (min(self.max_draft, 2 * drafted) if accepted == drafted
                                             else max(1, 2 * accepted + 1))

    def finished(self, request: Request) -> None:
        self._cap.pop(request.request_id, None)
        index = self._prompts.get(request.prefix_key)
        if index is None or request.request_id not in index.sequences:
            return
        index.history.append(request.request_id)
        if len(index.history) > self.history_per_prompt:
            del index.sequences[index.history.pop(0)]
            self._reindex(index)

    # ---- the index --------------------------------------------------------------------------------
    def _sequence(self, request: Request) -> tuple[_PromptIndex, _Sequence]:
        key = request.prefix_key
        index = self._prompts.get(key)
        if index is None:
            index = self._prompts[key] = _PromptIndex()
            if len(self._prompts) > self.max_prompts:
                self._prompts.popitem(last=False)
        else:
            self._prompts.move_to_end(key)
        seq = index.sequences.get(request.request_id)
        if seq is None:
            if index.prompt is None:
                index.prompt = list(request.prompt_ids)
                self._index(index, _Sequence(index.prompt, 0))
            seq = index.sequences[request.request_id] = _Sequence(list(request.token_ids), request.num_prompt_tokens)
            self._index(index, seq)
        return index, seq

    def _index(self, index: _PromptIndex, seq: _Sequence) -> None:
        """Enter the n-grams ending just before each token not yet indexed (its continuation is known)."""
        tokens, followers, top = seq.tokens, index.followers, self.max_ngram
        for pos in range(max(seq.indexed, 1), len(tokens)):
            token = tokens[pos]
            for n in range(1, min(top, pos) + 1):
                counts = followers.setdefault(tuple(tokens[pos - n: pos]), {})
                counts[token] = counts.get(token, 0) + 1
        seq.indexed = len(tokens)

    def _reindex(self, index: _PromptIndex) -> None:
        index.followers.clear()
        self._index(index, _Sequence(index.prompt, 0))
        for seq in index.sequences.values():
            seq.indexed = len(index.prompt)
            self._index(index, seq)
