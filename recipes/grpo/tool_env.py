"""A calculator the policy may call between turns: the tool protocol, a safe evaluator, the reply.

Protocol (plain text in any byte-level vocabulary): the model writes ``calc[17*23]``; the closing
``]`` is one token and a stop token of the rollout, so the turn ends right after it. The environment
reads the text between the last ``calc[`` and that ``]``, evaluates it and appends ``=391\\n`` (or
``=error: <why>\\n``) as environment tokens, after which the model writes its next turn.

The evaluator never calls ``eval``: a small recursive-descent parser over integers, ``+ - * /``,
unary minus and parentheses, in exact rational arithmetic (``7/2`` is ``7/2``, not ``3.5``). Bad
input of any kind -- garbage, division by zero, too long, too deep, too large -- becomes an error
reply; ``CalculatorEnv.reply`` never raises.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

OPEN = "calc["
CLOSE = "]"


class CalcError(ValueError):
    """An expression the calculator refuses; the message is what the model reads after ``=error: ``."""


@dataclass(frozen=True)
class ToolConfig:
    max_turns: int = 4
    """Turns per sample at most (a turn is one generation; every answered call adds one)."""
    max_expr_chars: int = 64
    """Longer expressions get an error reply, unparsed."""
    max_abs_value: int = 10**12
    """Any operand or intermediate result beyond this magnitude is an error (no huge-number blowups)."""
    sft_demo_fraction: float = 0.5
    """Share of SFT examples written as calculator demonstrations (the rest: the plain solution)."""
    demo_chunk: int = 4
    """Operators per calculator call in a demonstration: a longer chain takes several calls."""
    seed: int = 0
    """Which SFT examples become demonstrations."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_expr_chars", "max_abs_value", "demo_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"tool.{name}: expected an integer >= 1, got {value!r}")
        if not 0.0 <= self.sft_demo_fraction <= 1.0:
            raise ValueError(f"tool.sft_demo_fraction: expected a number in [0, 1], got {self.sft_demo_fraction!r}")


class _Parser:
    """expr := term (('+'|'-') term)* ; term := unary (('*'|'/') unary)* ;
    unary := '-' unary | atom ; atom := integer | '(' expr ')'. Spaces are ignored."""

    def __init__(self, text: str, max_abs: int) -> None:
        self.s, self.i, self.max_abs = text.replace(" ", ""), 0, max_abs

    def parse(self) -> Fraction:
        if not self.s:
            raise CalcError("empty expression")
        value = self.expr()
        if self.i != len(self.s):
            raise CalcError(f"unexpected {self.s[self.i]!r} at position {self.i}")
        return value

    def _peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def _bounded(self, v: Fraction) -> Fraction:
        if abs(v) > self.max_abs:
            raise CalcError(f"value beyond {self.max_abs}")
        return v

    def expr(self) -> Fraction:
        value = self.term()
        while self._peek() in ("+", "-"):
            op = self.s[self.i]
            self.i += 1
            rhs = self.term()
            value = self._bounded(value + rhs if op == "+" else value - rhs)
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self._peek() in ("*", "/"):
            op = self.s[self.i]
            self.i += 1
            rhs = self.unary()
            if op == "/" and rhs == 0:
                raise CalcError("division by zero")
            value = self._bounded(value * rhs if op == "*" else value / rhs)
        return value

    def unary(self) -> Fraction:
        if self._peek() == "-":
            self.i += 1
            return -self.unary()
        return self.atom()

    def atom(self) -> Fraction:
        c = self._peek()
        if c == "(":
            self.i += 1
            value = self.expr()
            if self._peek() != ")":
                raise CalcError(f"missing ')' at position {self.i}")
            self.i += 1
            return value
        start = self.i
        while self._peek().isdigit() and self._peek().isascii():
            self.i += 1
        if start == self.i:
            raise CalcError(f"expected a number at position {start}" if c else "expression ends early")
        return self._bounded(Fraction(int(self.s[start:self.i])))


def evaluate(text: str, max_chars: int = 64, max_abs: int = 10**12) -> Fraction:
    """The exact value of ``text`` (integers, ``+ - * /``, unary minus, parentheses); raises
    ``CalcError`` for anything else. Parenthesis depth is bounded by ``max_chars``."""
    if len(text) > max_chars:
        raise CalcError(f"expression longer than {max_chars} characters")
    return _Parser(text, max_abs).parse()


def render_value(v: Fraction) -> str:
    return str(v.numerator) if v.denominator == 1 else f"{v.numerator}/{v.denominator}"


class CalculatorEnv:
    """The calculator over one tokenizer: which token ends a call, and the reply to a turn."""

    def __init__(self, config: ToolConfig, tokenizer) -> None:
        self.config, self.tokenizer = config, tokenizer
        close = tokenizer.encode(CLOSE)
        if len(close) != 1:
            raise ValueError(f"tool: the closing {CLOSE!r} must be one token of this tokenizer (a stop token), "
                             f"got ids {close}")
        self.close_id = close[0]
        """The token that ends a calculator call."""
        self.stop_token_ids = (self.close_id,)
        """What the rollout must stop on besides eos."""

    def called(self, response_ids: list[int], finish_reason: str) -> bool:
        """Whether a turn ended by calling the calculator (it stopped on the closing token)."""
        return finish_reason == "stop" and bool(response_ids) and response_ids[-1] == self.close_id

    def reply_text(self, turn_text: str) -> tuple[str, bool]:
        """(the reply to a turn ending in ``]``, whether it is an error). Never raises."""
        try:
            start = turn_text.rfind(OPEN)
            if start < 0 or not turn_text.endswith(CLOSE):
                raise CalcError(f"no {OPEN}...{CLOSE} call")
            value = evaluate(turn_text[start + len(OPEN):-len(CLOSE)], self.config.max_expr_chars,
                             self.config.max_abs_value)
            return f"={render_value(value)}\n", False
        except CalcError as e:
            return f"=error: {e}\n", True
        except (RecursionError, ValueError, OverflowError) as e:  # defensive: stays a reply, never escapes
            return f"=error: {type(e).__name__}\n", True

    def reply_ids(self, turn_ids: list[int]) -> tuple[list[int], bool]:
        """[num_reply_tokens] the reply to a turn (its own tokens, [num_turn_tokens]) that called the
        calculator, and whether it is an error."""
        text, error = self.reply_text(self.tokenizer.decode(turn_ids))
        return self.tokenizer.encode(text), error
