"""Built-in tools: an exact calculator and a Python interpreter. Both run inside the sandbox, like user tools.

The calculator walks the expression's AST (never eval): numbers, + - * / // % ** and unary signs only, with bounds
on integer size and exponents, so `9**9**9` is refused in microseconds instead of eating the time limit.
"""

from __future__ import annotations

import ast
import contextlib
import io
import operator
import re
import traceback
from decimal import Decimal, DivisionByZero, InvalidOperation, localcontext

MAX_EXPRESSION_CHARS = 1000
MAX_INT_DIGITS = 1000  # results and operands beyond this are refused
MAX_EXPONENT = 10_000
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")

_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UN = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator will not evaluate; the message says why (the model reads it)."""


def _digits(x: int | Decimal) -> int:
    return len(str(abs(int(x)))) if isinstance(x, int) else max(0, x.adjusted() + 1)


def _pow(a, b):
    if isinstance(b, Decimal) and b != b.to_integral_value():
        if a < 0:
            raise CalculatorError("a negative number to a fractional power is not real")
        if abs(b) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {b} is larger than {MAX_EXPONENT}")
        return a**b
    n = int(b)
    if abs(n) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {n} is larger than {MAX_EXPONENT}")
    if a not in (0, 1, -1) and _digits(a) * abs(n) > MAX_INT_DIGITS + 1:
        raise CalculatorError(f"result would have more than {MAX_INT_DIGITS} digits")
    if isinstance(a, int) and n < 0:
        return Decimal(a) ** n
    return a**n


def _eval(node: ast.AST, src: str):
    """Evaluate one AST node of `src`; ints stay exact ints, anything with a decimal point or a / is a Decimal."""
    if isinstance(node, ast.Expression):
        return _eval(node.body, src)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.Constant) and type(node.value) is float:
        return Decimal(ast.get_source_segment(src, node) or repr(node.value))  # the literal's text, exactly
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UN:
        return _UN[type(node.op)](_eval(node.operand, src))
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        a, b = _eval(node.left, src), _eval(node.right, src)
        if isinstance(a, Decimal) or isinstance(b, Decimal) or type(node.op) is ast.Div:
            a, b = Decimal(a), Decimal(b)
        out = _pow(a, b) if type(node.op) is ast.Pow else _BIN[type(node.op)](a, b)
        if _digits(out) > MAX_INT_DIGITS:
            raise CalculatorError(f"result has more than {MAX_INT_DIGITS} digits")
        return out
    if isinstance(node, ast.Call):
        raise CalculatorError("function calls are not allowed; only numbers and + - * / // % ** ( )")
    if isinstance(node, ast.Name | ast.Attribute):
        raise CalculatorError("names are not allowed; only numbers and + - * / // % ** ( )")
    raise CalculatorError(f"{type(node).__name__} is not allowed; only numbers and + - * / // % ** ( )")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly; returns the result as text."""
    if not isinstance(expression, str):
        raise CalculatorError("expression must be a string")
    expr = expression.strip().replace("^", "**").replace("\u00d7", "*").replace("\u00f7", "/")
    expr = _THOUSANDS.sub("", expr)  # 1,234,567 -> 1234567; other commas stay (and are refused)
    if not expr:
        raise CalculatorError("empty expression")
    if len(expr) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an arithmetic expression: {e.msg}") from None
    with localcontext() as ctx:
        ctx.prec = 50
        ctx.traps[DivisionByZero] = True
        ctx.traps[InvalidOperation] = True
        try:
            return _format(_eval(tree, expr))
        except (ZeroDivisionError, DivisionByZero):
            raise CalculatorError("division by zero") from None
        except InvalidOperation:
            raise CalculatorError("undefined result") from None


def _format(x: int | Decimal) -> str:
    if isinstance(x, int):
        return str(x)
    if x == x.to_integral_value() and abs(x) < Decimal(10) ** 30:
        return str(int(x))
    return format(x.normalize(), "f") if abs(x.adjusted()) < 30 else str(x.normalize())


class _TailBuffer(io.TextIOBase):
    """A text stream that keeps at most `limit` characters (the tail) and counts what it dropped."""

    def __init__(self, limit: int):
        self.limit, self.parts, self.size, self.dropped = limit, [], 0, 0

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self.parts.append(s)
        self.size += len(s)
        if self.size > 2 * self.limit:
            text = "".join(self.parts)
            self.dropped += len(text) - self.limit
            self.parts, self.size = [text[-self.limit:]], self.limit
        return len(s)

    def getvalue(self) -> str:
        text = "".join(self.parts)
        if len(text) > self.limit:
            self.dropped += len(text) - self.limit
            text = text[-self.limit:]
        return text


def python(code: str, _output_limit: int = 65536) -> str:
    """Run a Python program; returns its stdout then stderr (the tails, if long), and the traceback if it raised."""
    if not isinstance(code, str):
        raise TypeError("code must be a string")
    out, err = _TailBuffer(_output_limit), _TailBuffer(_output_limit)
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            exec(compile(code, "<tool>", "exec"), scope)  # noqa: S102 - this IS the Python tool, run in the sandbox
        except SystemExit as e:
            if e.code not in (None, 0):
                print(f"exit status {e.code}", file=err)
        except MemoryError:
            raise  # reported as the call's memory error, not as program output
        except Exception as e:  # noqa: BLE001 - the program's error is its output, for the model to read
            tb = e.__traceback__.tb_next if e.__traceback__ else None  # drop this function's own frame
            print("".join(traceback.format_exception(type(e), e, tb)), end="", file=err)
    text = out.getvalue()
    stderr = err.getvalue()
    if out.dropped:
        text = f"[... {out.dropped} characters cut ...]\n" + text
    if stderr:
        text += ("\n" if text and not text.endswith("\n") else "") + "[stderr]\n" + stderr
    return text
