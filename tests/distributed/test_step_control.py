"""The driver's per-step message is a few hundred bytes: it carries no tokens (every rank samples its
share of the rows and one all-gather brings the rest), never grows with batch or context length, and a
switch adds bytes, not page tables. Under DP-attention the ranks meet once per token window, and the
tokens, logprobs and finish reasons are those of meeting every step. Replicas that scheduled
differently stop with an error naming both counts before any token is applied (2 spawned ranks)."""
from __future__ import annotations

import pytest

from benchmarks.step_overhead import admit_as_decoding, warm_requests
from splash_rollout.engine.rank_engine import Engine
from splash_rollout.rollout.build import engine_settings
from splash_rollout.rollout.config import EngineConfig
from splash_rollout.engine.request import Request, SamplingSpec
from splash_rollout.models.config import PRESETS
from splash_rollout.models.model import MLAForCausalLM
from splash_rollout.models.numerics import numerics

PAGE = 16
# one small layer: the message does not depend on the model, the KV of 256 x 8192 tokens must fit
CFG = PRESETS["glm5-nano"].replace(name="ctl", num_layers=1, indexer_types=("full",), kv_lora_rank=16,
                                   qk_rope_head_dim=8, index_head_dim=8, max_position_embeddings=16384)


def _dp_settings(ctx, pages: int, rows: int, seqs: int, decode_window: int = 8):
    """DP-attention over the group: ``pages`` per rank, ``rows`` per step, ``seqs`` running at most."""
    return engine_settings(EngineConfig(model=CFG, parallel=dict(world_size=ctx.world_size, layout="dp",
                                                                 decode_window=decode_window),
                                        memory=dict(num_pages=pages, page_size=PAGE),
                                        batching=dict(max_num_batched_tokens=rows, max_num_seqs=seqs),
                                        compute=dict(speculation="off")))


def decode_steps(ctx, batch: int, context: int, switch_to: str | None = None) -> list[dict] | None:
    """Every rank: ``batch`` requests put straight into decode at ``context`` tokens, then 3 steps in
    DP-attention (a switch to ``switch_to`` requested before the third). Rank 0: the step log."""
    pages = -(-batch // ctx.world_size) * (-(-(context + 16) // PAGE)) + batch
    settings = _dp_settings(ctx, pages, batch, batch, decode_window=1)  # a message before every step
    engine = Engine(MLAForCausalLM.from_config(CFG, seed=0).eval(), CFG, ctx.groups, settings)
    admit_as_decoding(engine.scheduler, warm_requests(CFG, batch, context))
    engine.serve([], max_steps=2)
    if switch_to is not None:
        engine.request_switch(switch_to)
    engine.serve([], max_steps=1)
    engine.abort_all()
    return list(engine.step_log) if ctx.rank == 0 else None


@pytest.mark.slow
def test_control_bytes_do_not_grow_with_context(group2):
    short = group2.run(decode_steps, 256, 64)[0]
    long = group2.run(decode_steps, 256, 8192, "dop")[0]
    # steps 0 and 1 decode 256 requests; step 2 switches DP -> DOP
    print("control bytes per step, S=64:", [s.control_bytes for s in short],
          "S=8192:", [s.control_bytes for s in long])
    assert long[1].requests == 256 and long[1].rows == 256  # a real decode step of B = 256
    assert long[1].control_bytes <= 1024 and long[1].control_bytes == long[0].control_bytes  # no tokens
    assert long[1].control_bytes == short[1].control_bytes  # the same at 64 and 8,192 tokens of history
    assert long[2].layout == "dop" and long[2].control_bytes <= 64 * 1024  # the switching step
    assert long[2].control_bytes - long[1].control_bytes < 512  # a switch order is a few bytes


def diverging_step(ctx) -> str | None:
    """Every rank: one decode step of 8 requests, rank 1's replica with a smaller row budget."""
    settings = _dp_settings(ctx, 64, 8, 8)
    engine = Engine(MLAForCausalLM.from_config(CFG, seed=0).eval(), CFG, ctx.groups, settings)
    admit_as_decoding(engine.scheduler, warm_requests(CFG, 8, 32))
    if ctx.rank == 1:
        engine.scheduler.max_num_batched_tokens = 7
    try:
        engine.serve([], max_steps=1)
    except RuntimeError as e:
        return str(e)
    return None


def test_replicas_that_scheduled_differently_stop_with_both_counts(group2):
    errors = group2.run(diverging_step)
    assert "rank 0: scheduler replica diverged from rank 1's in step 0: it sampled 8 tokens over 8 rows, " \
           "rank 1 7 over 7" in errors[0]
    assert "rank 1: scheduler replica diverged from rank 0's" in errors[1]


def stopping_requests() -> list[Request]:
    """12 sampled requests of different lengths whose stop tokens end most of them early, at steps no
    window boundary knows in advance."""
    return [Request(i, [3 + (7 * i + k) % 500 for k in range(5 + 7 * i)],
                    SamplingSpec(temperature=1.0, max_new_tokens=30 + i, stop_token_ids=tuple(range(3, 10)),
                                 seed=50 + i), CFG.max_position_embeddings) for i in range(12)]


def windowed_run(ctx, window: int):
    """Every rank: DP-attention serves ``stopping_requests`` with token windows of at most ``window``
    steps (reproducible numerics: a row's result does not depend on the batch). Rank 0: the outputs,
    the finish reasons, the steps that carried a control message, and the pages left in use."""
    settings = _dp_settings(ctx, 128, 96, 16, decode_window=window)
    with numerics("reproducible"):
        engine = Engine(MLAForCausalLM.from_config(CFG, seed=0).eval(), CFG, ctx.groups, settings)
        finished = engine.serve(stopping_requests())
    if ctx.rank:
        return None
    return ({r.request_id: (r.output_ids, r.output_logprobs, r.finish_reason) for r in finished},
            sum(1 for s in engine.step_log if s.control_bytes), len(engine.step_log),
            engine.scheduler.placement.pages_in_use)


def test_token_windows_give_the_tokens_of_meeting_every_step(group2):
    every_step = group2.run(windowed_run, 1)[0]
    windowed = group2.run(windowed_run, 8)[0]
    outputs, messages, steps, pages_left = windowed
    reasons = [reason for _, _, reason in outputs.values()]
    assert reasons.count("stop") >= 4 and "length" in reasons  # stops inside windows, and caps
    assert outputs == every_step[0]  # tokens, logprobs and finish reasons, bit for bit
    assert every_step[1] == every_step[2]  # window 1: a message before every step
    assert messages <= steps // 2  # windows: the ranks met at most every other step
    assert pages_left == [0, 0]
