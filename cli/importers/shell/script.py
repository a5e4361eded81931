"""Read a run script as bash would expand it, without running anything: the words of its launch command.

verl's example and recipe scripts set shell variables before they launch (`max_prompt_length=$((1024 * 2))`,
`MODEL_PATH=${MODEL_PATH:-"${HOME}/verl/models/..."}`, arrays of overrides, `export`s) and pass them to
`python3 -m verl.trainer.main_ppo` (or `recipe.dapo.main_dapo`, or the same behind `ray job submit ... --`). This
module follows the script from the top down to that command, keeping the variables it assigns, and expands the
command's words as bash does (GNU Bash manual, "Shell Expansions"): parameter expansion with every `${...}` operator
verl's scripts use, `$((...))` integer arithmetic, quote removal, word splitting of unquoted expansions, arrays and
`"$@"`. Nothing is executed: a value that would need a command's output (`$(...)`), a condition, or a variable that
is neither assigned by the script nor set in the environment given stays `Unresolved`, naming what it depends on,
so the importer can refuse it by name instead of writing `$name` into a config.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from dgrpo.cli.importers.shell.expand import Shell, Unresolved, Value, join_values
from dgrpo.cli.importers.shell.lex import ScriptError, Token, tokenize

__all__ = ["LaunchCommand", "ScriptError", "ScriptReading", "Unresolved", "read_script"]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\[[^\]]*\])?(\+?)=", re.DOTALL)
_COMPOUND_OPEN, _COMPOUND_CLOSE = {"if", "for", "while", "until", "case", "select"}, {"fi", "done", "esac"}
_LAUNCH_MODULE = re.compile(r"^(verl|recipe)\.|(^|\.)main_\w+$")


@dataclass
class LaunchCommand:
    """The launch command's arguments after the module or script it runs, expanded; and the lines it spans."""

    program: list[Value]
    args: list[Value]
    line: int


@dataclass
class ScriptReading:
    """What reading a script found: the launch command (None if it has none) and the shell state before it."""

    launch: LaunchCommand | None
    shell: Shell
    commands: list[list[Value]] = field(default_factory=list)
    """Every other simple command's words, expanded (scripts of bare overrides have no launch command)."""


def _commands(tokens: list[Token]) -> list[tuple[list[str], str, int]]:
    """Simple commands: (raw words, the operator before it, line). `name ()` becomes the word `name()`."""
    out: list[tuple[list[str], str, int]] = []
    words: list[str] = []
    before, line, k = "\n", 0, 0
    while k < len(tokens):
        tok = tokens[k]
        if tok.kind == "word":
            line = line if words else tok.line
            words.append(tok.text)
        elif tok.text == "(" and words and k + 1 < len(tokens) and tokens[k + 1].text == ")":
            words[-1] += "()"
            k += 1
        else:
            if words:
                out.append((words, before, line))
                words = []
            before = tok.text
        k += 1
    if words:
        out.append((words, before, line))
    return out


def _is_python(word: Value) -> bool:
    return isinstance(word, str) and re.fullmatch(r"(.*/)?(python(\d+(\.\d+)?)?|torchrun)", word) is not None


def _launch_index(words: list[Value]) -> int | None:
    """Index after the module (`-m verl.trainer.main_ppo`) or script (`.../main_ppo.py`) a command launches."""
    for k, w in enumerate(words):
        if not isinstance(w, str):
            continue
        if w == "-m" and k + 1 < len(words) and isinstance(words[k + 1], str) and \
                _LAUNCH_MODULE.search(words[k + 1]) and any(_is_python(x) for x in words[:k]):
            return k + 2
        if re.search(r"(^|/)main_\w+\.py$", w) and k and _is_python(words[k - 1]):
            return k + 1
    return None


def read_script(text: str, env: Mapping[str, str], script_path: str = "script.sh") -> ScriptReading:
    """Follow the script's assignments down to its launch command and expand that command's words."""
    shell = Shell(env, script_path)
    reading = ScriptReading(None, shell)
    depth = 0  # inside if / for / while / case: assignments there depend on a condition
    in_function, opened, braces = False, False, 0  # a function body runs only when called: skipped
    for raw, before, line in _commands(tokenize(text)):
        if in_function or raw[0].endswith("()") or raw[0] == "function":
            if not in_function:
                in_function, opened, braces = True, False, 0
            braces += raw.count("{") - raw.count("}")
            opened = opened or "{" in raw
            if opened and braces <= 0:
                in_function = False
            continue
        while raw and raw[0] in ("then", "else", "elif", "do", "!", "{", "}"):
            depth += (raw[0] == "{") - (raw[0] == "}")
            raw = raw[1:]
        if not raw:
            continue
        if raw[0] in _COMPOUND_OPEN:
            depth += 1
            continue
        if raw[0] in _COMPOUND_CLOSE:
            depth -= 1
            continue
        conditional = depth > 0 or before in ("&&", "||")
        why = f"assigned on line {line} under a condition, which dgrpo does not evaluate" if conditional else ""
        rest = _assignments(shell, raw, why, line)
        if not rest:
            continue
        command = rest[0]
        if command in ("export", "declare", "typeset", "local", "readonly"):
            _assignments(shell, [w for w in rest[1:] if not w.startswith("-")], why, line, all_words=True)
            continue
        if command == "unset" and not conditional:
            for name in rest[1:]:
                if not name.startswith("-"):
                    shell.vars.pop(name, None)
                    shell.unset.add(name)
            continue
        if command == "read":
            for name in rest[1:]:
                if _NAME.fullmatch(name):
                    shell.taint(name, f"read from input on line {line}")
            continue
        if command in ("source", "."):
            shell.notes.append(f"the script sources {' '.join(rest[1:])} on line {line}, which dgrpo does not read")
            continue
        expanded = _expand_words(shell, rest, line)
        k = _launch_index(expanded)
        if k is not None:
            tail = expanded[k:]
            stop = next((j for j, w in enumerate(tail) if isinstance(w, str) and re.fullmatch(r"\d*>.*|<.*", w)),
                        len(tail))
            reading.launch = LaunchCommand(expanded[:k], tail[:stop], line)
            return reading
        reading.commands.append(expanded)
    return reading


def _expand_words(shell: Shell, words: list[str], line: int) -> list[Value]:
    out: list[Value] = []
    for w in words:
        try:
            out.extend(shell.expand_word(w))
        except (ScriptError, ValueError, IndexError) as e:  # syntax this reader does not follow: named by its line
            out.append(Unresolved((w,), f"line {line}: {e}", w))
    return out


def _assignments(shell: Shell, words: list[str], why: str, line: int, all_words: bool = False) -> list[str]:
    """Apply the leading NAME=value words (all of them with `all_words`); the words after them."""
    for k, w in enumerate(words):
        m = _ASSIGN.match(w)
        if not m:
            if all_words:
                continue
            return words[k:]
        name, index, append = m.group(1), m.group(2), bool(m.group(3))
        value_raw = w[m.end() :]
        if why:
            shell.taint(name, why)
        elif index:
            shell.taint(name, f"array element assigned on line {line}")
        elif value_raw.startswith("(") and value_raw.endswith(")"):
            body = value_raw[1:-1]
            items = [f for t in tokenize(body) if t.kind == "word" for f in shell.expand_word(t.text)]
            shell.assign(name, items, append)
        else:
            shell.assign(name, join_values(shell.expand_word(value_raw, split=False, tilde_after="=")), append)
    return []
