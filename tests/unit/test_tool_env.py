"""The calculator environment: exact values for well-formed expressions, an error reply (never an
exception) for anything else, and SFT demonstrations whose replies are masked."""
from __future__ import annotations

import random
from fractions import Fraction

import pytest

from splash_rollout.recipes.grpo.task_data import Example
from splash_rollout.recipes.grpo.tool_demos import demo_segments, is_demo, sft_target
from splash_rollout.recipes.grpo.tool_env import CalcError, CalculatorEnv, ToolConfig, evaluate
from splash_rollout.models.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("glm5-nano")


@pytest.fixture(scope="module")
def env(tok):
    return CalculatorEnv(ToolConfig(), tok)


@pytest.mark.parametrize("text, value", [
    ("17*23", 391), ("1+2*3", 7), ("(1+2)*3", 9), ("10-4-3", 3), ("8/2/2", 2), ("7/2", Fraction(7, 2)),
    ("-3+5", 2), ("2*-3", -6), ("--4", 4), ("-(3-5)*2", 4), (" 1 + 2 ", 3), ("0", 0), ("007", 7),
    ("1-2+3-4+5", 3), ("6/4*2", 3), ("((((2))))", 2),
])
def test_values(text, value):
    assert evaluate(text) == value


@pytest.mark.parametrize("text, why", [
    ("1/0", "division by zero"), ("5/(2-2)", "division by zero"), ("", "empty expression"),
    ("abc", "expected a number at position 0"), ("1+", "expression ends early"), ("1+*2", "expected a number"),
    ("(1+2", "missing ')'"), ("1+2)", "unexpected ')'"), ("3.5", "unexpected '.'"), ("2**3", "expected a number"),
    ("1" * 13, "value beyond"), ("999999*999999*999999", "value beyond"), ("١+٢", "expected a number"),
    ("__import__('os')", "expected a number"), ("1e5", "unexpected 'e'"),
])
def test_bad_expressions_are_refused_with_a_reason(text, why):
    with pytest.raises(CalcError, match=why.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        evaluate(text)


def test_replies(env):
    assert env.reply_text("calc[17*23]") == ("=391\n", False)
    assert env.reply_text("I will add: calc[1+2]") == ("=3\n", False)
    assert env.reply_text("calc[1+1]=2\ncalc[2*5]") == ("=10\n", False)  # the last call counts
    assert env.reply_text("calc[7/2]") == ("=7/2\n", False)
    assert env.reply_text("calc[1/0]") == ("=error: division by zero\n", True)
    assert env.reply_text("calc[x+1]") == ("=error: expected a number at position 0\n", True)
    assert env.reply_text("no call here]") == ("=error: no calc[...] call\n", True)
    long = "calc[" + "+".join(["1"] * 100) + "]"
    assert env.reply_text(long) == ("=error: expression longer than 64 characters\n", True)
    deep = "calc[" + "(" * 5000 + "1" + ")" * 5000 + "]"  # far past the length cap: never parsed
    assert env.reply_text(deep)[1] is True


def test_reply_never_raises_on_garbage(env, tok):
    rng = random.Random(0)
    alphabet = "0123456789+-*/() calc[]x.=\n\x00é"
    for _ in range(2000):
        text = "calc[" + "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80))) + "]"
        reply, error = env.reply_text(text)
        assert reply.startswith("=") and reply.endswith("\n")
        assert error == reply.startswith("=error: ")
    for _ in range(200):  # token ids, decoded: any byte soup the model might write
        ids, bad = env.reply_ids([rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))] + [env.close_id])
        assert ids and isinstance(bad, bool)


def test_called_only_on_the_closing_token(env, tok):
    call = tok.encode("calc[1+2]")
    assert call[-1] == env.close_id and env.stop_token_ids == (env.close_id,)
    assert env.called(call, "stop")
    assert not env.called(call, "length")  # cut by the budget right on ']': not a finished call
    assert not env.called(tok.encode("1+2=3#3") + [1], "stop")
    assert not env.called([], "stop")


def test_config_is_checked():
    with pytest.raises(ValueError, match="tool.max_turns"):
        ToolConfig(max_turns=0)
    with pytest.raises(ValueError, match="tool.sft_demo_fraction"):
        ToolConfig(sft_demo_fraction=1.5)


def test_demonstrations_chunk_the_chain_and_mask_the_replies(tok):
    assert demo_segments("1+2+1+3+2-1=?", 4) == [("calc[1+2+1+3+2]", True), ("=9\n", False),
                                                 ("calc[9-1]", True), ("=8\n", False), ("#8", True)]
    assert demo_segments("2-2=?", 4) == [("calc[2-2]", True), ("=0\n", False), ("#0", True)]
    with pytest.raises(ValueError, match="arithmetic chain"):
        demo_segments("what is 2+2?", 4)
    env = CalculatorEnv(ToolConfig(sft_demo_fraction=1.0), tok)
    ex = Example([0], {"prompt": "1+2+1+3+2-1=?"}, 8, "1+2=3,3+1=4,4+3=7,7+2=9,9-1=8#8", "sft", 0)
    ids, mask = sft_target(ex, tok, env)
    assert tok.decode(ids) == "calc[1+2+1+3+2]=9\ncalc[9-1]=8\n#8"
    assert ids[-1] == tok.eos_token_ids[0] and len(mask) == len(ids)
    masked = [i for i, m in zip(ids, mask) if m == 0]
    assert masked == tok.encode("=9\n") + tok.encode("=8\n")
    plain = CalculatorEnv(ToolConfig(sft_demo_fraction=0.0), tok)
    ids, mask = sft_target(ex, tok, plain)
    assert ids == tok.encode(ex.target) + [tok.eos_token_ids[0]] and mask == [1] * len(ids)


def test_demo_share_follows_the_fraction():
    examples = [Example([0], {}, 0, "", "sft", i) for i in range(2000)]
    share = sum(is_demo(e, 0.3, seed=5) for e in examples) / len(examples)
    assert 0.26 < share < 0.34
    assert [is_demo(e, 0.3, 5) for e in examples[:50]] != [is_demo(e, 0.3, 6) for e in examples[:50]]
