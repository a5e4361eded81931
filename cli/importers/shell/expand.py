"""bash's expansions of a word (GNU Bash manual, "Shell Expansions"), over the variables a script has assigned and
the environment it runs in: parameter expansion with the `${...}` operators (defaults, alternatives, lengths,
prefix / suffix removal, substitution, case, substrings, arrays), `$((...))` arithmetic (cli/importers/shell/arith.py),
quote removal, word splitting of unquoted expansions, `"${array[@]}"` and `"$@"`. What bash would only know at run
time (a command's output, an unset variable used bare, `$RANDOM`) is an `Unresolved`, which names what it depends
on and keeps the word's text as far as it is known.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase

from dgrpo.cli.importers.shell.arith import Arith, ArithUnknown
from dgrpo.cli.importers.shell.lex import ScriptError, skip_quoted

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_VOLATILE = {"RANDOM", "SRANDOM", "SECONDS", "EPOCHSECONDS", "EPOCHREALTIME", "BASHPID", "LINENO", "PPID"}


@dataclass(frozen=True)
class Unresolved:
    """A value bash would only know at run time: the variables (or constructs) it depends on, and why."""

    names: tuple[str, ...]
    why: str
    text: str = ""
    """The word as far as it is known: expanded text, with each unknown part as the script writes it."""

    def __add__(self, other: Unresolved) -> Unresolved:
        names = tuple(dict.fromkeys(self.names + other.names))
        why = self.why if other.why in self.why else f"{self.why}; {other.why}"
        return Unresolved(names, why, self.text + other.text)

    def describe(self) -> str:
        return f"{', '.join(self.names)} ({self.why})"


Value = str | Unresolved
_UNSET = object()


class Shell:
    """The variables as the script leaves them, and bash's expansions over them."""

    def __init__(self, env: Mapping[str, str], script_path: str = "script.sh"):
        self.env = dict(env)
        self.vars: dict[str, object] = {"0": script_path, "#": "0"}
        self.unset: set[str] = set()
        self.notes: list[str] = []

    # -- variables --

    def lookup(self, name: str) -> object:
        """str, list (array), Unresolved, or _UNSET."""
        if name in self.vars:
            return self.vars[name]
        if name in _VOLATILE or name in ("$", "!", "?", "-", "_"):
            return Unresolved((f"${name}",), "differs from run to run")
        if name.isdigit():
            return _UNSET  # the script is read without arguments
        if name in self.unset:
            return _UNSET
        return self.env.get(name, _UNSET)

    def assign(self, name: str, value: object, append: bool = False) -> None:
        self.unset.discard(name)
        if append:
            old = self.lookup(name)
            old = "" if old is _UNSET else old
            if isinstance(value, list):
                old = old if isinstance(old, list) else [old]
                value = old + value
            elif isinstance(old, Unresolved) or isinstance(value, Unresolved):
                value = join_values([old, value])
            else:
                value = (old[0] if isinstance(old, list) and old else old) + value
        self.vars[name] = value

    def taint(self, name: str, why: str) -> None:
        self.vars[name] = Unresolved((f"${name}",), why)

    def _missing(self, name: str) -> Unresolved:
        why = ("the script's arguments are not given" if name.isdigit() else
               "neither assigned by the script before its launch command nor set in the environment")
        if self.notes:
            why += "; " + "; ".join(self.notes)
        return Unresolved((f"${name}",), why)

    # -- words --

    def expand_word(self, raw: str, split: bool = True, tilde_after: str = "") -> list[Value]:
        """One raw word -> its fields after expansion and quote removal (split=False: exactly one field)."""
        pieces: list[tuple[object, bool]] = []  # (str | list | Unresolved, quoted)
        i, n = 0, len(raw)
        if raw.startswith("~") and (split or tilde_after):
            m = re.match(r"~(?=/|$)", raw)
            if m:
                pieces.append((self._var_value("HOME"), True))
                i = 1
        while i < n:
            c = raw[i]
            if c == "'":
                j = raw.index("'", i + 1)
                pieces.append((raw[i + 1 : j], True))
                i = j + 1
            elif c == '"':
                j = skip_quoted(raw, i)
                pieces.extend((p, True) for p in self._expand_dquoted(raw[i + 1 : j - 1]))
                if j - i == 2:
                    pieces.append(("", True))
                i = j
            elif c == "\\":
                if raw[i + 1 : i + 2] != "\n":
                    pieces.append((raw[i + 1 : i + 2], True))
                i += 2
            elif c == "$" and raw[i + 1 : i + 2] == "'":
                j = i + 2
                while raw[j] != "'":
                    j += 2 if raw[j] == "\\" else 1
                pieces.append((_ansi_c(raw[i + 2 : j]), True))
                i = j + 1
            elif c == "$" or c == "`":
                value, i = self._expand_dollar(raw, i)
                pieces.append((value, False))
            else:
                j = i
                while j < n and raw[j] not in "'\"\\$`":
                    j += 1
                lit = raw[i:j]
                if tilde_after and ":~/" in lit:
                    home = self._var_value("HOME")
                    if isinstance(home, str):
                        lit = lit.replace(":~/", f":{home}/")
                pieces.append((lit, True))
                i = j
        return _fields(pieces, split)

    def expand_string(self, raw: str) -> Value:
        """A word expanded without field splitting (assignment values, `${...}` operands)."""
        return join_values(self.expand_word(raw, split=False))

    def _var_value(self, name: str) -> Value:
        v = self.lookup(name)
        if v is _UNSET:
            return self._missing(name)
        return v[0] if isinstance(v, list) and v else ("" if isinstance(v, list) else v)

    def _expand_dquoted(self, body: str) -> list[object]:
        out: list[object] = []
        i, n = 0, len(body)
        while i < n:
            c = body[i]
            if c == "\\" and body[i + 1 : i + 2] in ("$", "`", '"', "\\", "\n"):
                if body[i + 1] != "\n":
                    out.append(body[i + 1])
                i += 2
            elif c in "$`":
                value, i = self._expand_dollar(body, i)
                out.append(value)
            else:
                j = i + 1
                while j < n and body[j] not in "\\$`":
                    j += 1
                out.append(body[i:j])
                i = j
        return out

    def _expand_dollar(self, text: str, i: int) -> tuple[object, int]:
        """The expansion starting at text[i] ($... or backquote) and the index after it; an unknown value carries
        the source text of the expansion."""
        value, j = self._expand_dollar_value(text, i)
        if isinstance(value, Unresolved):
            value = replace(value, text=text[i:j])
        return value, j

    def _expand_dollar_value(self, text: str, i: int) -> tuple[object, int]:
        if text[i] == "`" or text.startswith("$(", i) and not text.startswith("$((", i):
            j = skip_quoted(text, i)
            return Unresolved((text[i:j],), "command substitution: dgrpo does not run the script's commands"), j
        if text.startswith("$((", i):
            j = skip_quoted(text, i)
            if text[j - 2 : j] != "))":  # `$( (subshell) )`, not arithmetic
                return Unresolved((text[i:j],), "command substitution: dgrpo does not run the script's commands"), j
            return self.arith(text[i + 3 : j - 2]), j
        if text.startswith("${", i):
            j = skip_quoted(text, i)
            return self._braced(text[i + 2 : j - 1]), j
        m = _NAME.match(text, i + 1)
        if m:
            return self._var_value(m.group()), m.end()
        nxt = text[i + 1 : i + 2]
        if nxt.isdigit():
            return self._missing(nxt) if self.lookup(nxt) is _UNSET else self.lookup(nxt), i + 2
        if nxt in ("@", "*"):
            return [], i + 2  # no arguments
        if nxt and nxt in "#$!?-_":
            return self.lookup(nxt), i + 2
        return "$", i + 1

    def _braced(self, body: str) -> object:
        """`${...}`: bash's parameter expansions (Bash manual, "Shell Parameter Expansion")."""
        if body.startswith("#") and len(body) > 1 and body[1] not in "}":
            v = self._param(body[1:])
            if isinstance(v, Unresolved):
                return v
            if v is _UNSET:
                return self._missing(body[1:])
            return str(len(v)) if isinstance(v, list) and body.endswith("]") else str(len(_scalar(v)))
        if body.startswith("!"):
            return Unresolved((f"${{{body}}}",), "indirect expansion is not followed")
        m = re.match(r"([A-Za-z_][A-Za-z0-9_]*|[0-9]+|[@*#?$!-])(\[[^\]]*\])?", body)
        if not m:
            raise ScriptError(f"${{{body}}}: bad substitution")
        name, rest = m.group(), body[m.end() :]
        v = self._param(name)
        label = name.split("[")[0]
        if not rest:
            if isinstance(v, list) and "[" not in name:
                return v[0] if v else ""  # $arr is its first element
            return self._missing(label) if v is _UNSET else v
        m_op = re.match(r":[-=+?]|[-=+?]|##|#|%%|%|//|/#|/%|/|\^\^|\^|,,|,|:|@", rest)
        if not m_op:
            raise ScriptError(f"${{{body}}}: bad substitution")
        op = m_op.group()
        word = rest[len(op) :]
        if op in (":-", "-", ":=", "=", ":+", "+", ":?", "?"):
            if isinstance(v, Unresolved):
                return v
            empty = v is _UNSET or (op.startswith(":") and _scalar(v) == "")
            if op.endswith("-"):
                return self.expand_string(word) if empty else v
            if op.endswith("="):
                if empty:
                    self.assign(label, self.expand_string(word))
                return self.lookup(label)
            if op.endswith("+"):
                return "" if empty else self.expand_string(word)
            if empty:
                why = word or "parameter null or not set"
                return Unresolved((f"${label}",), f"unset, and the script stops there: {why}")
            return v
        if v is _UNSET:
            return self._missing(label)
        if isinstance(v, Unresolved):
            return v
        values = v if isinstance(v, list) else [v]
        if op == ":":
            return self._substring(values, v, word)
        if op == "@":
            return Unresolved((f"${{{body}}}",), "parameter transformation is not followed")
        pattern = self.expand_string(word.split("/", 1)[0] if op.startswith("/") else word)
        if isinstance(pattern, Unresolved):
            return pattern
        out = [_pattern_op(x, op, pattern, self._replacement(op, word)) for x in values]
        if any(isinstance(x, Unresolved) for x in out):
            return join_values(out)
        return out if isinstance(v, list) else out[0]

    def _replacement(self, op: str, word: str) -> Value:
        if not op.startswith("/") or "/" not in word:
            return ""
        return self.expand_string(word.split("/", 1)[1])

    def _substring(self, values: list[str], v: object, word: str) -> object:
        parts = word.split(":", 1)
        offset = self.arith(parts[0])
        length = self.arith(parts[1]) if len(parts) > 1 else None
        if isinstance(offset, Unresolved) or isinstance(length, Unresolved):
            return offset if isinstance(offset, Unresolved) else length
        if isinstance(v, list):
            start = int(offset)
            return values[start : start + int(length) if length is not None else None]
        s = values[0]
        start = int(offset) if int(offset) >= 0 else max(len(s) + int(offset), 0)
        if length is None:
            return s[start:]
        end = start + int(length) if int(length) >= 0 else len(s) + int(length)
        return s[start:end]

    def _param(self, ref: str) -> object:
        """A name, `name[@]` / `name[*]` / `name[i]`, or a special parameter -> its value (or _UNSET)."""
        m = re.fullmatch(r"(.+?)\[(.*)\]", ref)
        if not m:
            if ref in ("@", "*"):
                return []
            return self.lookup(ref)
        v = self.lookup(m.group(1))
        if v is _UNSET or isinstance(v, Unresolved):
            return v
        items = v if isinstance(v, list) else [v]
        if m.group(2) in ("@", "*"):
            return items
        index = self.arith(m.group(2))
        if isinstance(index, Unresolved):
            return index
        k = int(index)
        return items[k] if -len(items) <= k < len(items) else _UNSET

    # -- arithmetic --

    def _arith_variable(self, name: str) -> str:
        v = self.lookup(name)
        if v is _UNSET:
            raise ArithUnknown(self._missing(name))
        if isinstance(v, Unresolved):
            raise ArithUnknown(v)
        return _scalar(v)

    def arith(self, expr: str) -> Value:
        """`$((expr))`: bash's integer arithmetic (C operators, truncating division, `**`)."""
        text = self.expand_string(expr.replace('"', ""))
        if isinstance(text, Unresolved):
            return text
        try:
            return str(Arith(text, self._arith_variable).parse())
        except ArithUnknown as e:
            return e.value
        except (ZeroDivisionError, IndexError, ValueError) as e:
            raise ScriptError(f"$(({expr})): {e}") from None


# ---- helpers -----------------------------------------------------------------------------------------------------


def _scalar(v: object) -> str:
    if isinstance(v, list):
        return v[0] if v else ""
    return "" if v is _UNSET else v  # type: ignore[return-value]


def join_values(parts: list[object]) -> Value:
    flat = [x for p in parts for x in (p if isinstance(p, list) else [p])]
    bad = [p for p in flat if isinstance(p, Unresolved)]
    if bad:
        out = bad[0]
        for b in bad[1:]:
            out = out + b
        text = "".join(p.text if isinstance(p, Unresolved) else str(p) for p in parts if not isinstance(p, list))
        return replace(out, text=text if not any(isinstance(p, list) for p in parts) else out.text)
    return "".join(" ".join(p) if isinstance(p, list) else str(p) for p in parts)


def _fields(pieces: list[tuple[object, bool]], split: bool) -> list[Value]:
    """Concatenate expanded pieces into fields: unquoted expansions split on blanks, `"${a[@]}"` one field each."""
    if split and len(pieces) == 1 and isinstance(pieces[0][0], list) and pieces[0][1]:
        return list(pieces[0][0])  # "${arr[@]}": one field per element, unknown ones included
    if any(isinstance(p, Unresolved) or (isinstance(p, list) and any(isinstance(x, Unresolved) for x in p))
           for p, _ in pieces):
        return [join_values([p for p, _ in pieces])]
    if not split:
        return [join_values([p for p, _ in pieces])]
    fields: list[str] = []
    current: str | None = None
    for value, quoted in pieces:
        if isinstance(value, list):
            if not value:
                continue
            items = value if quoted else [w for item in value for w in item.split()]
            if not items:
                continue
            fields.append((current or "") + items[0])
            fields.extend(items[1:])
            current = fields.pop()
            continue
        if quoted:
            current = (current or "") + value
            continue
        words = value.split()
        if not words:
            continue
        if value[0].isspace() and current is not None:
            fields.append(current)
            current = None
        for k, w in enumerate(words):
            if k:
                fields.append(current)
                current = None
            current = (current or "") + w
        if value[-1].isspace():
            fields.append(current)
            current = None
    if current is not None:
        fields.append(current)
    return fields


def _pattern_op(s: str, op: str, pattern: str, repl: Value) -> Value:
    if isinstance(repl, Unresolved):
        return repl
    if op in ("^^", "^", ",,", ","):
        f = str.upper if op.startswith("^") else str.lower
        return f(s) if len(op) == 2 else (f(s[:1]) + s[1:])
    if op in ("#", "##"):
        cuts = [k for k in range(len(s) + 1) if fnmatchcase(s[:k], pattern)]
        return s[(max(cuts) if op == "##" else min(cuts)):] if cuts else s
    if op in ("%", "%%"):
        cuts = [k for k in range(len(s) + 1) if fnmatchcase(s[k:], pattern)]
        return s[: (min(cuts) if op == "%%" else max(cuts))] if cuts else s
    if op == "/#":
        cuts = [k for k in range(len(s), -1, -1) if fnmatchcase(s[:k], pattern)]
        return repl + s[cuts[0]:] if cuts else s
    if op == "/%":
        cuts = [k for k in range(len(s) + 1) if fnmatchcase(s[k:], pattern)]
        return s[: cuts[0]] + repl if cuts else s
    out, i = "", 0  # "/" first match, "//" every match; longest match at each position
    while i <= len(s):
        end = next((k for k in range(len(s), i - 1, -1) if pattern and fnmatchcase(s[i:k], pattern)), None)
        if end is None:
            if i < len(s):
                out += s[i]
            i += 1
            continue
        out += repl
        if op == "/":
            return out + s[end:]
        if end == i:
            if i < len(s):
                out += s[i]
            i += 1
        else:
            i = end
    return out


def _ansi_c(body: str) -> str:
    table = {"n": "\n", "t": "\t", "\\": "\\", "'": "'", '"': '"', "r": "\r", "a": "\a", "e": "\x1b"}
    return re.sub(r"\\(.)", lambda m: table.get(m.group(1), "\\" + m.group(1)), body)
