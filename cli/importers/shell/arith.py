"""bash's `$((...))` integer arithmetic (GNU Bash manual, "Shell Arithmetic"): C operators and precedence,
division truncating toward zero, `**`, `?:`, hex / octal / base#digits literals, variables named bare inside the
expression (their values are expressions in turn). Assignments inside the expression are not followed.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Callable

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ArithUnknown(Exception):
    """A variable of the expression is known only at run time: `value` says which (a shell_script.Unresolved)."""

    def __init__(self, value: object):
        self.value = value


class Arith:
    """A Pratt parser over bash's arithmetic grammar (Bash manual, "Shell Arithmetic"), evaluating as it parses."""

    TOKEN = re.compile(r"\s*(0[xX][0-9a-fA-F]+|\d+#[0-9a-zA-Z@_]+|\d+|[A-Za-z_][A-Za-z0-9_]*|\*\*|<<|>>|<=|>=|==|!=|"
                       r"&&|\|\||\+\+|--|[-+*/%<>&|^!~?:(),=])")
    BINARY: typing.ClassVar[dict[str, int]] = {
        ",": 1, "||": 3, "&&": 4, "|": 5, "^": 6, "&": 7, "==": 8, "!=": 8, "<": 9, ">": 9, "<=": 9, ">=": 9,
        "<<": 10, ">>": 10, "+": 11, "-": 11, "*": 12, "/": 12, "%": 12, "**": 13}

    def __init__(self, text: str, lookup: Callable[[str], str], depth: int = 0):
        self.lookup, self.depth, self.pos = lookup, depth, 0
        self.tokens: list[str] = []
        rest = text.strip()
        while rest:
            m = self.TOKEN.match(rest)
            if not m:
                raise ValueError(f"syntax error near {rest!r}")
            self.tokens.append(m.group(1))
            rest = rest[m.end() :].strip()

    def parse(self) -> int:
        if not self.tokens:
            return 0
        value = self.expr(0)
        if self.pos != len(self.tokens):
            raise ValueError(f"syntax error near {self.tokens[self.pos]!r}")
        return value

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise ValueError("unexpected end of expression")
        self.pos += 1
        return tok

    def expr(self, min_prec: int) -> int:
        left = self.unary()
        while True:
            op = self.peek()
            if op == "?" and min_prec <= 2:
                self.take()
                a = self.expr(1)
                if self.take() != ":":
                    raise ValueError("`?` without `:`")
                b = self.expr(2)
                left = a if left else b
                continue
            if op in ("=", "++", "--"):
                raise ValueError("assignments inside $((...)) are not followed")
            prec = self.BINARY.get(op or "")
            if prec is None or prec < min_prec:
                return left
            self.take()
            right = self.expr(prec if op == "**" else prec + 1)
            left = _binary(op, left, right)

    def unary(self) -> int:
        tok = self.take()
        if tok in ("-", "+", "!", "~"):
            v = self.unary()
            return {"-": -v, "+": v, "!": int(not v), "~": ~v}[tok]
        if tok == "(":
            v = self.expr(0)
            if self.take() != ")":
                raise ValueError("missing `)`")
            return v
        if tok[0].isdigit():
            return _number(tok)
        if _NAME.fullmatch(tok):
            text = self.lookup(tok).strip()  # a variable's value is itself an expression (bash evaluates it)
            if self.depth > 16:
                raise ValueError(f"{tok}: expression recursion level exceeded")
            return Arith(text, self.lookup, self.depth + 1).parse() if text else 0
        raise ValueError(f"syntax error near {tok!r}")


def _number(tok: str) -> int:
    if tok[:2].lower() == "0x":
        return int(tok, 16)
    if "#" in tok:
        base, digits = tok.split("#", 1)
        return int(digits, int(base))
    return int(tok, 8) if len(tok) > 1 and tok[0] == "0" else int(tok)


def _binary(op: str, a: int, b: int) -> int:
    if op in ("/", "%"):
        if b == 0:
            raise ZeroDivisionError("division by 0")
        q = abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1)  # C: truncation toward zero
        return q if op == "/" else a - b * q
    if op == "**":
        if b < 0:
            raise ValueError("exponent less than 0")
        return a**b
    table = {",": lambda: b, "||": lambda: int(bool(a or b)), "&&": lambda: int(bool(a and b)), "|": lambda: a | b,
             "^": lambda: a ^ b, "&": lambda: a & b, "==": lambda: int(a == b), "!=": lambda: int(a != b),
             "<": lambda: int(a < b), ">": lambda: int(a > b), "<=": lambda: int(a <= b), ">=": lambda: int(a >= b),
             "<<": lambda: a << b, ">>": lambda: a >> b, "+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b}
    return table[op]()
