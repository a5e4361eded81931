"""Splitting a shell script into words and control operators, as bash's parser does for the subset run scripts use:
quotes, `$(...)` / `${...}` / backquotes kept whole inside a word, `NAME=( ... )` array assignments as one word,
comments, line continuations, and here-document bodies skipped (they are data, not commands). Words keep their
quotes: expansion (cli/importers/shell/script.py) removes them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_OPS = ("&&", "||", "|&", ";;", ";", "&", "|", "\n", "(", ")")
_ARRAY_START = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\+?=")


class ScriptError(ValueError):
    """The script uses shell syntax this reader does not follow (the message says which, and where)."""


@dataclass
class Token:
    kind: str  # "word" or "op"
    text: str
    line: int
    heredoc: bool = False


def skip_quoted(text: str, i: int) -> int:
    """Index after the construct starting at text[i] (a quote, `$(`, `${`, backquote), quotes nested inside."""
    c = text[i]
    if c == "'":
        j = text.find("'", i + 1)
        if j < 0:
            raise ScriptError("unterminated single quote")
        return j + 1
    if c == "`":
        j = i + 1
        while j < len(text) and text[j] != "`":
            j += 2 if text[j] == "\\" else 1
        if j >= len(text):
            raise ScriptError("unterminated backquote")
        return j + 1
    if c == '"':
        j = i + 1
        while j < len(text) and text[j] != '"':
            if text[j] == "\\":
                j += 2
            elif text[j] in "$`":
                j = skip_quoted(text, j) if text[j] == "`" or text[j + 1 : j + 2] in ("(", "{") else j + 1
            else:
                j += 1
        if j >= len(text):
            raise ScriptError("unterminated double quote")
        return j + 1
    # `$(`, `$((`, `${`: nesting by brackets, with quotes skipped
    open_, close = ("(", ")") if text[i + 1] == "(" else ("{", "}")
    depth, j = 0, i + 1
    while j < len(text):
        ch = text[j]
        if ch in "'\"`":
            j = skip_quoted(text, j)
            continue
        if ch == "\\":
            j += 2
            continue
        if ch == "$" and text[j + 1 : j + 2] in ("(", "{"):
            j = skip_quoted(text, j)
            continue
        depth += ch == open_
        depth -= ch == close
        j += 1
        if depth == 0:
            return j
    raise ScriptError(f"unterminated {text[i:i + 2]}")


def tokenize(text: str) -> list[Token]:
    """Words (raw, quotes kept) and control operators; comments, line continuations and here-document bodies gone."""
    tokens: list[Token] = []
    i, line, n = 0, 1, len(text)
    pending_heredocs: list[tuple[str, bool]] = []
    while i < n:
        c = text[i]
        if c == "\\" and text[i + 1 : i + 2] == "\n":
            i, line = i + 2, line + 1
            continue
        if c in " \t\r":
            i += 1
            continue
        if c == "#":
            while i < n and text[i] != "\n":
                i += 1
            continue
        if c == "\n":
            tokens.append(Token("op", "\n", line))
            i, line = i + 1, line + 1
            for delim, strip in pending_heredocs:  # a here-document's body is data, not commands
                while i < n:
                    end = text.find("\n", i)
                    end = n if end < 0 else end
                    body_line = text[i:end]
                    i, line = end + 1, line + 1
                    if (body_line.lstrip("\t") if strip else body_line) == delim:
                        break
            pending_heredocs.clear()
            continue
        op = next((o for o in _OPS if text.startswith(o, i)), None)
        if op:
            tokens.append(Token("op", op, line))
            i += len(op)
            continue
        start, start_line = i, line
        while i < n and (text[i] not in " \t\r\n;&|()" or (text[i] == "(" and _ARRAY_START.fullmatch(text[start:i]))):
            ch = text[i]
            if ch == "(":  # an array assignment NAME=( ... )
                depth, i = 1, i + 1
                while i < n and depth:
                    if text[i] in "'\"`":
                        i = skip_quoted(text, i)
                        continue
                    if text[i] == "#" and text[i - 1] in " \t\n(":
                        while i < n and text[i] != "\n":
                            i += 1
                        continue
                    line += text[i] == "\n"
                    depth += (text[i] == "(") - (text[i] == ")")
                    i += 1
                continue
            if ch == "\\":
                line += text[i + 1 : i + 2] == "\n"
                i += 2
            elif ch in "'\"`" or (ch == "$" and text[i + 1 : i + 2] in ("(", "{")):
                j = skip_quoted(text, i)
                line += text.count("\n", i, j)
                i = j
            elif ch in "<>" and text.startswith("<<", i) and not text.startswith("<<<", i):
                break
            else:
                i += 1
        word = text[start:i]
        if word:
            tokens.append(Token("word", word, start_line))
        if text.startswith("<<", i) and not text.startswith("<<<", i):  # here-document: remember its delimiter
            i += 2
            strip = text[i : i + 1] == "-"
            i += strip
            while i < n and text[i] in " \t":
                i += 1
            m = re.match(r"""(['"]?)([^\s'";&|<>()]+)\1""", text[i:])
            if not m:
                raise ScriptError(f"line {line}: here-document without a delimiter")
            pending_heredocs.append((m.group(2), strip))
            i += m.end()
    return tokens
