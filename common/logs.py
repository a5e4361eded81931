"""One log format for every service, so `dgrpo up` can prefix and interleave them readably; `printable` makes
text a client sent safe to put in a log line, `bounded` short enough to return in a gRPC status."""

from __future__ import annotations

import logging
import os
import unicodedata

_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    if ch in _ESCAPES:
        return _ESCAPES[ch]
    # Control, format (bidi overrides, zero-width), surrogate, private and unassigned characters, and the Unicode
    # line / paragraph separators: each could fake a line or hide text in a terminal.
    if unicodedata.category(ch)[0] == "C" or ch in "\u2028\u2029":
        code = ord(ch)
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
    return ch


def printable(text: object, limit: int = 200) -> str:
    """`text` as one log-safe line: newlines, control and invisible characters escaped (a backslash too, so the
    escapes are unambiguous), at most `limit` characters of output plus a marker saying how many were cut.

    For anything a client chose (a stop reason, a spec name, an error quoting a request): raw, a 1 MB reason with
    newlines would write forged lines into the log."""
    text = str(text)
    out: list[str] = []
    size = 0
    for i, ch in enumerate(text):
        piece = _escape(ch)
        if size + len(piece) > limit:
            return "".join(out) + f"...[{len(text) - i} more chars]"
        out.append(piece)
        size += len(piece)
    return "".join(out)


MAX_ERROR_BYTES = 2000
"""Longest error message (UTF-8 bytes) a client gets back. gRPC sends it percent-encoded in a trailer, and a trailer
over the client's metadata limit (8 KiB) turns the whole answer into RESOURCE_EXHAUSTED "Stream removed": a message
quoting a 20 kB prompt_id or path would hide why the request was refused."""


def bounded(message: str, limit: int = MAX_ERROR_BYTES) -> str:
    """`message`, cut to `limit` UTF-8 bytes with a marker saying how much was left out."""
    raw = message.encode()
    if len(raw) <= limit:
        return message
    return raw[:limit].decode(errors="ignore") + f"...[{len(raw) - limit} more bytes]"


def setup_logging(service: str, level: str | None = None) -> logging.Logger:
    level = level or os.environ.get("DGRPO_LOG_LEVEL", "INFO")
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s [{service}] %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    return logging.getLogger(f"dgrpo.{service}")
