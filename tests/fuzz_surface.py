"""A hypothesis fuzz of RolloutEngine's public surface, shared by the one-rank and the spawned-rank tests.

Random SamplingParams fields (valid values next to NaN, inf, huge, negative and wrong types), random
prompts (ids, strings, empty, out of vocabulary, nested wrong types), and random sequences of
generate / update_weights / sleep / wake_up / abort. Every call must either succeed with well-formed
samples (tokens in the vocabulary, one finite logprob <= 0 per token, a documented finish reason, n
samples per prompt) or raise ValueError / TypeError naming a field, or RuntimeError for a call the
engine's state does not allow (asleep, not asleep); afterwards the engine serves a fixed call exactly
as before.
"""
from __future__ import annotations

import re
import threading

import torch
from hypothesis import event
from hypothesis import strategies as st

from splash_rollout import RolloutEngine, SamplingParams

VOCAB = 512
FINISH_REASONS = {"stop", "length", "abort", "error"}
NAMED = re.compile(r"^[A-Za-z_][\w.]*(\[\d+\])*(\.\w+)?(\[\d+\])?: ")  # "field: ...", "prompts[3][1]: ..."
PROBE = ([[5, 6, 7], [9, 10]], SamplingParams(n=2, max_new_tokens=3, seed=11, ignore_eos=True))

wild_number = st.sampled_from([float("nan"), float("inf"), -float("inf"), -1, -1e9, 0, 1e-30, 10**30, 2**63, True])
wrong_type = st.sampled_from(["3", None, [1], {"a": 1}, b"x", 2.5 + 1j])
VALID = {
    "n": st.integers(1, 3),
    "temperature": st.sampled_from([0.0, 0.7, 1.0, 1.5, 1e4]),
    "top_p": st.sampled_from([1.0, 0.9, 0.3]),
    "top_k": st.sampled_from([-1, 0, 1, 5, 600, 10**30]),
    "min_p": st.sampled_from([0.0, 0.1, 1.0]),
    "max_new_tokens": st.integers(1, 4) | st.just(10**9),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "ignore_eos": st.booleans(),
    "seed": st.none() | st.integers(-2**70, 2**70),
}
WILD = {name: wild_number | wrong_type for name in VALID}
WILD["stop_token_ids"] = st.lists(st.integers(-3, VOCAB + 3), min_size=1, max_size=3) | wrong_type


@st.composite
def sampling_kwargs(draw) -> dict:
    """Valid values for a random subset of the fields, and now and then one field made wild."""
    kw = draw(st.fixed_dictionaries({}, optional=VALID))
    if draw(st.integers(0, 3)) == 0:
        name = draw(st.sampled_from(sorted(VALID)))
        kw[name] = draw(WILD[name])
    return kw


good_prompt = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12) | st.text(min_size=1, max_size=12)
bad_prompt = st.one_of(
    st.lists(st.integers(-5, VOCAB + 5), max_size=6).filter(lambda ids: not ids or min(ids) < 0 or max(ids) >= VOCAB),
    st.just(""),
    st.lists(st.lists(st.integers(0, 9), max_size=2), min_size=1, max_size=2),  # nested: wrong type
    st.lists(st.sampled_from([1.5, "a", None, True]), min_size=1, max_size=2),
    st.sampled_from([None, 7, b"ab", {"ids": [1]}, torch.tensor([1.0]), torch.tensor(3)]),
)


@st.composite
def prompts(draw):
    """Mostly good prompt lists; now and then one bad prompt in them, or a bad container."""
    ps = draw(st.lists(good_prompt, min_size=1, max_size=3))
    roll = draw(st.integers(0, 5))
    if roll == 0:
        ps.insert(draw(st.integers(0, len(ps))), draw(bad_prompt))
    elif roll == 1:
        return draw(st.sampled_from([None, [], "one string prompt", 5, [torch.tensor([3, 4])]]))
    return ps


operation = st.one_of(
    st.tuples(st.just("generate"), prompts(), sampling_kwargs(), st.booleans()),
    st.tuples(st.just("generate"), prompts(), sampling_kwargs(), st.booleans()),  # bool: abort it meanwhile
    st.tuples(st.just("update_weights"), st.sampled_from(["same", "nan", "shard", "unknown", "not_a_dict"])),
    st.tuples(st.just("sleep")), st.tuples(st.just("wake_up")), st.tuples(st.just("abort")),
)
operations = st.lists(operation, min_size=1, max_size=4)


def _push(kind: str, weights: dict[str, torch.Tensor]):
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    if kind == "same":
        return {name: weights[name]}
    if kind == "nan":
        return {name: torch.full_like(weights[name], float("nan"))}
    if kind == "shard":
        return {name: weights[name][: weights[name].shape[0] // 2]}
    if kind == "unknown":
        return {"model.nope.weight": torch.zeros(1)}
    return [(name, weights[name])]


def _check_batch(batch, num_prompts: int, params: SamplingParams) -> None:
    assert len(batch.groups) == num_prompts
    for g in batch.groups:
        assert len(g.samples) == params.n
        for s in g.samples:
            assert s.finish_reason in FINISH_REASONS, s.finish_reason
            assert len(s.response_ids) == len(s.response_logprobs) <= params.max_new_tokens
            assert all(0 <= t < VOCAB for t in s.response_ids)
            assert all(lp <= 0 and lp == lp and lp != -float("inf") for lp in s.response_logprobs)
            assert s.finish_reason == "abort" or s.response_ids or s.finish_reason == "error"


def _expect_named(error: BaseException) -> None:
    assert NAMED.match(str(error)), f"{type(error).__name__} does not name a field: {error}"


def run_operations(engine: RolloutEngine, ops, weights: dict[str, torch.Tensor], probe_tokens) -> None:
    """Apply ``ops`` to ``engine`` and check every outcome; leaves the engine awake and checks it
    still answers ``PROBE`` with ``probe_tokens``."""
    for op in ops:
        kind = op[0]
        try:
            if kind == "generate":
                _, ps, kw, abort_meanwhile = op
                try:
                    params = SamplingParams(**kw)
                except (ValueError, TypeError) as e:
                    _expect_named(e)
                    event(f"SamplingParams: {type(e).__name__}")
                    continue
                aborter = threading.Timer(0.01, engine.abort) if abort_meanwhile else None
                if aborter is not None:
                    aborter.start()
                try:
                    batch = engine.generate(ps, params)
                finally:
                    if aborter is not None:
                        aborter.cancel()
                        aborter.join()
                _check_batch(batch, len(batch.groups), params)
                event(f"generate returned {sum(len(g.samples) for g in batch.groups)} samples")
                assert len(batch.groups) == (1 if isinstance(ps, str) else len(ps))
            elif kind == "update_weights":
                engine.update_weights(_push(op[1], weights))
                assert op[1] == "same", f"update_weights accepted a bad push ({op[1]})"
            elif kind == "sleep":
                engine.sleep()
            elif kind == "wake_up":
                engine.wake_up()
            else:
                assert engine.abort() == 0  # nothing is running between calls
        except (ValueError, TypeError) as e:
            _expect_named(e)
            event(f"{kind}: {type(e).__name__}")
        except RuntimeError as e:
            assert kind in ("generate", "update_weights", "sleep", "wake_up") and (
                "asleep" in str(e) or "not asleep" in str(e)), e
            _expect_named(e)
    if engine.is_sleeping:
        engine.wake_up()
    assert [s.response_ids for s in engine.generate(*PROBE).samples] == probe_tokens
