"""The token-window rule: a window opens only where nothing but a stop can change the batch before it
closes, and ends before a length cap, a scheduled switch, the call's step limit or a page shortage."""
from __future__ import annotations

import torch

from benchmarks.step_overhead import admit_as_decoding
from splash_rollout.engine.placement import KVPlacement
from splash_rollout.engine.request import Request, SamplingSpec
from splash_rollout.engine.request_scheduler import Scheduler
from splash_rollout.engine.token_window import TokenWindow, provisional, window_steps
from splash_rollout.layout.layouts import Layout

PAGE = 4


def decoding(pages: int = 64, caps: tuple[int, ...] = (20, 20, 20, 20), context: int = 6) -> Scheduler:
    """A DP scheduler over 2 ranks whose requests all decode (``context`` tokens, one uncomputed)."""
    scheduler = Scheduler(KVPlacement([pages, pages], PAGE, Layout.DP), max_num_batched_tokens=64, max_num_seqs=8)
    admit_as_decoding(scheduler, [Request(i, list(range(3, 3 + context)), SamplingSpec(max_new_tokens=cap), 4096)
                                  for i, cap in enumerate(caps)])
    return scheduler


def test_a_steady_decode_batch_gets_the_longest_window():
    assert window_steps(8, decoding(), None, None) == 8


def test_limits_shorten_the_window():
    assert window_steps(8, decoding(caps=(20, 3, 20, 20)), None, None) == 3  # a length cap ends it
    assert window_steps(8, decoding(), 5, None) == 5  # the call's step limit
    assert window_steps(8, decoding(), None, 2) == 2  # a scheduled switch
    # 2 requests per rank, 5 positions computed (2 pages each) and 3 pages free per rank: after K steps
    # a request holds 5 + K positions, 3 pages up to K = 7 (2 new per rank), 4 at K = 8 (4 new: short)
    scheduler = decoding(pages=7)
    assert scheduler.placement.pages_free == [3, 3]
    assert window_steps(8, scheduler, None, None) == 7


def test_anything_that_changes_the_batch_keeps_one_step():
    queued = decoding()
    queued.add(Request(9, [3, 4, 5], SamplingSpec(), 4096))
    assert window_steps(8, queued, None, None) == 1  # an admission may come
    prefill = decoding()
    prefill.running[0].num_computed_tokens = 2
    assert window_steps(8, prefill, None, None) == 1  # a chunk, not a one-row decode
    assert window_steps(1, decoding(), None, None) == 1


def test_settle_cuts_at_the_first_stop_and_keeps_the_rest_otherwise():
    spec = SamplingSpec(max_new_tokens=10, stop_token_ids=(7,))
    stops, runs = Request(0, [1, 2], spec, 4096), Request(1, [1, 2], spec, 4096)
    for r in (stops, runs):
        r.append_token(5, -0.5)
    window = TokenWindow(3)
    for step, (a, b) in enumerate([(4, 4), (7, 6), (9, 8)]):  # request 0 samples its stop token at step 2
        full_tokens, full_logprobs = provisional([0, 1], 0, [a], [-1.0])
        assert full_tokens == [a, 0]  # the other rank's token is a stand-in until the window closes
        for r, t, lp in zip((stops, runs), full_tokens, full_logprobs):
            r.append_provisional(t, lp)
        window.hold([a], [-1.0])
    assert window.is_over and window.held()[0] == [[4], [7], [9]]
    assert stops.settle([4, 7, 9], [-1.0, -2.0, -3.0]) == 1
    assert (stops.output_ids, stops.output_logprobs, stops.finish_reason) == ([5, 4, 7], [-0.5, -1.0, -2.0], "stop")
    assert runs.settle([4, 6, 8], [-1.0, -1.0, -1.0]) == 0
    assert (runs.output_ids, runs.finish_reason) == ([5, 4, 6, 8], None)
