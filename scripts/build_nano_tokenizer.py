"""Regenerate splash_rollout/assets/glm5-nano/tokenizer.json (deterministic, offline, seconds).

A byte-level BPE with exactly 512 ids (ModelConfig "glm5-nano".vocab_size): 0 = <s> (bos),
1 = </s> (eos), 2 = <pad>, then the 256 byte symbols, then merges learned on a generated corpus of
arithmetic / reasoning-style text. Digits are split one per token so numbers tokenize uniformly.

    python scripts/build_nano_tokenizer.py [--out PATH]
"""
from __future__ import annotations

import argparse
import os
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "..", "splash_rollout", "assets", "glm5-nano", "tokenizer.json")

_WORDS = ["answer", "step", "the", "is", "so", "then", "first", "next", "finally", "we", "add", "subtract",
          "multiply", "result", "total", "check", "question", "compute", "equals", "therefore", "sum",
          "product", "difference", "number", "think", "let", "us", "of", "and", "to", "a", "each", "has",
          "how", "many", "what", "left", "more", "less", "times", "apples", "books", "coins", "boxes",
          "because", "since", "which", "when", "there", "are", "were", "was", "be", "not", "only", "all",
          "after", "before", "gives", "give", "gets", "buys", "sells", "spends", "pays", "costs", "price",
          "dollars", "hours", "minutes", "days", "weeks", "students", "friends", "cars", "pages", "eggs",
          "divide", "half", "double", "twice", "remaining", "altogether", "per", "every", "in", "on", "by",
          "with", "from", "for", "at", "if", "it", "this", "that", "these", "value", "values", "correct",
          "wrong", "verify", "solve", "solution", "problem", "equation", "reasoning", "final", "write",
          "known", "given", "find", "need", "want", "start", "end", "plus", "minus", "over", "under",
          "Tom", "Anna", "Mia", "Sam", "Lee", "Ravi", "Olga", "has", "had", "have", "will", "would"]


def _problem(rng: random.Random) -> str:
    a, b, c = rng.randint(0, 999), rng.randint(0, 999), rng.randint(1, 99)
    op = rng.choice("+-*")
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    kind = rng.randrange(4)
    if kind == 0:
        return f"Question: what is {a} {op} {b}?\nStep 1: compute {a} {op} {b} = {value}.\nAnswer: {value}\n"
    if kind == 1:
        total = value + c
        return (f"Let us think step by step. First, {a} {op} {b} = {value}. Next, {value} + {c} = {total}. "
                f"Therefore the answer is {total}.\n")
    if kind == 2:
        thing = rng.choice(["apples", "books", "coins", "boxes"])
        return (f"Each of {c} boxes has {a} {thing}. How many {thing} in total? "
                f"step: {c} * {a} = {c * a}. answer = {c * a}\n")
    words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12)))
    return f"{words}, {a} {op} {b} = {value}; check: the result is {value}.\n"


def corpus(n: int = 20000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [_problem(rng) for _ in range(n)]


def build() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer: expected {VOCAB_SIZE} ids, got {tok.get_vocab_size()}")
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT)
    out = os.path.abspath(parser.parse_args().out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    build().save(out, pretty=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
