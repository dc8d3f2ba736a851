"""A tiny, safe arithmetic evaluator for the calculator tool (no ``eval``, no ``ast`` exec).

Grammar (recursive descent, usual precedence, left-associative)::

    expr   := term (("+" | "-") term)*
    term   := unary (("*" | "/" | "%") unary)*
    unary  := ("+" | "-") unary | atom
    atom   := NUMBER | "(" expr ")"
    NUMBER := digits ["." digits]

Values are exact ``fractions.Fraction``; ``format_value`` prints an integer when the result is
whole and a decimal rounded to 6 places otherwise. There is no exponentiation, and inputs and
intermediate magnitudes are bounded (``MAX_CHARS``, ``MAX_DEPTH``, ``MAX_ABS``) so a model
cannot make the environment burn memory or CPU. Every failure raises ``ExpressionError`` with
a short message meant to be shown back to the model; the calculator env turns it into a reply,
never into a crashed rollout.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_CHARS = 80
MAX_DEPTH = 16
MAX_ABS = Fraction(10**12)

_TOKEN_RE = re.compile(r"\s*(?:(\d+(?:\.\d+)?)|(.))")


class ExpressionError(ValueError):
    """The expression is malformed, too large, or divides by zero."""


def _tokenize(text: str) -> list[str]:
    tokens: list[str] = []
    for match in _TOKEN_RE.finditer(text):
        number, op = match.groups()
        if number is not None:
            tokens.append(number)
        elif op is not None and not op.isspace():
            if op not in "+-*/%()":
                raise ExpressionError(f"unexpected character {op!r}")
            tokens.append(op)
    return tokens


class _Parser:
    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.depth = 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise ExpressionError("unexpected end of expression")
        self.pos += 1
        return token

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = _bounded(value + self.term() if self.take() == "+" else value - self.term())
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/", "%"):
            op = self.take()
            rhs = self.unary()
            if op == "*":
                value = _bounded(value * rhs)
            elif rhs == 0:
                raise ExpressionError("division by zero")
            else:
                value = _bounded(value / rhs if op == "/" else value % rhs)
        return value

    def unary(self) -> Fraction:
        if self.peek() in ("+", "-"):
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise ExpressionError("expression nested too deeply")
            sign = self.take()
            value = self.unary()
            self.depth -= 1
            return -value if sign == "-" else value
        return self.atom()

    def atom(self) -> Fraction:
        token = self.take()
        if token == "(":
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise ExpressionError("expression nested too deeply")
            value = self.expr()
            if self.take() != ")":
                raise ExpressionError("missing ')'")
            self.depth -= 1
            return value
        if token[0].isdigit():
            return _bounded(Fraction(token))
        raise ExpressionError(f"unexpected {token!r}")


def _bounded(value: Fraction) -> Fraction:
    if abs(value) > MAX_ABS:
        raise ExpressionError("number too large")
    return value


def evaluate(text: str) -> Fraction:
    """Evaluate an arithmetic expression exactly; raises ``ExpressionError`` on bad input."""
    if len(text) > MAX_CHARS:
        raise ExpressionError(f"expression longer than {MAX_CHARS} characters")
    tokens = _tokenize(text)
    if not tokens:
        raise ExpressionError("empty expression")
    parser = _Parser(tokens)
    value = parser.expr()
    if parser.peek() is not None:
        raise ExpressionError(f"unexpected {parser.peek()!r}")
    return value


def format_value(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    text = f"{float(value):.6f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text
