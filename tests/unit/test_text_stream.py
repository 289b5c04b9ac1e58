"""The server's incremental detokenization (serve/app.py TextStream): the pieces a stream hands out
add up to the whole text decoded at once, whatever the tokens per piece; a stop string is cut
wherever it falls across pieces, and no character of it is ever handed out."""
from __future__ import annotations

import random

import pytest

from splash_rollout.models.tokenizer import load_tokenizer
from splash_rollout.serve.app import TextStream

TOKENIZER = load_tokenizer("glm5-nano")


def _pieces(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        k = rng.randint(1, 4)
        out.append(ids[i:i + k])
        i += k
    return out


@pytest.mark.parametrize("seed", range(5))
def test_pieces_add_up_to_the_whole_text(seed):
    rng = random.Random(seed)
    ids = TOKENIZER.encode("The answer: 3*(4+5) = 27, then 12+7=19 and 100/4 = 25. Done!")
    ids += [rng.randrange(3, 512) for _ in range(40)]
    stream = TextStream(TOKENIZER, [], incremental=True)
    shown = "".join(stream.push(p, [0.0] * len(p)) for p in _pieces(ids, rng)) + stream.finish()
    assert shown == stream.text == TOKENIZER.decode(ids)


@pytest.mark.parametrize("seed", range(5))
def test_a_stop_string_is_cut_across_pieces_and_never_shown(seed):
    rng = random.Random(seed)
    text = "first part, then STOP here and more after"
    ids = TOKENIZER.encode(text)
    stream = TextStream(TOKENIZER, ["STOP", "never"], incremental=True)
    shown = ""
    for p in _pieces(ids, rng):
        shown += stream.push(p, [0.0] * len(p))
        assert "S" not in shown.split("then")[-1]
        if stream.stopped:
            break
    shown += stream.finish()
    assert stream.stopped and shown == stream.text == TOKENIZER.decode(ids)[:TOKENIZER.decode(ids).index("STOP")]


def test_without_a_listener_nothing_is_decoded_until_the_end():
    ids = TOKENIZER.encode("12+7=19")
    stream = TextStream(TOKENIZER, [], incremental=False)
    assert stream.push(ids[:3], [0.0] * 3) == "" and stream.text == ""
    stream.push(ids[3:], [0.0] * (len(ids) - 3))
    assert stream.finish() == "12+7=19" == stream.text
