"""What every `dgrpo import-config` translation shares: the result (`Imported`), one-key rules, and the sorting
of the keys no rule took into ignored (dgrpo behaves the same) and unsupported (it behaves differently)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any


class Unsupported(Exception):
    """A key whose value dgrpo cannot reproduce; the message is the reason."""


@dataclass
class Imported:
    """The translation: dgrpo dotted key -> value, where each came from, and the keys left behind."""

    values: dict[str, Any] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)
    ignored: dict[str, str] = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)

    def set(self, key: str, value: Any, origin: str) -> None:
        self.values[key], self.origin[key] = value, origin


# ---- shared conversions ------------------------------------------------------------------------------------


def _as_list(v: Any) -> list:
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _run_name(v: Any) -> str:
    return (re.sub(r"[^A-Za-z0-9_.]", "_", str(v)) or "dgrpo")[:64]


def _loggers(v: Any) -> list[str]:
    names = [str(x) for x in _as_list(v) if str(x) not in ("none", "None")]
    names = ["jsonl" if n == "file" else n for n in names]  # verl's file logger writes a jsonl of metrics
    offered = ["console", "jsonl", "tensorboard", "wandb", "mlflow"]
    unknown = [n for n in names if n not in offered]
    if unknown:
        raise Unsupported(f"loggers {unknown} are not offered ({', '.join(offered)})")
    return sorted({"console", "jsonl", *names}, key=offered.index)


def _device(v: Any) -> str:
    if str(v) not in ("auto", "npu", "cuda", "cpu"):
        raise Unsupported(f"device {v!r} is not offered (npu, cuda, cpu)")
    return str(v)


def _schedule(v: Any) -> str:
    table = {"constant": "constant", "constant_with_warmup": "constant", "cosine": "cosine", "linear": "linear"}
    if str(v) not in table:
        raise Unsupported(f"lr schedule {v!r} is not offered (constant, cosine, linear)")
    return table[str(v)]


def _apply(flat: dict, out: Imported, rules: dict[str, tuple[str, Any]], used: set[str]) -> None:
    """Direct one-key rules: source key -> (dgrpo key, conversion or None)."""
    for src, (dst, conv) in rules.items():
        if src not in flat:
            continue
        used.add(src)
        if flat[src] is None:
            out.ignored[src] = f"null (unset): {dst} keeps dgrpo's default or what it derives"
            continue
        try:
            out.set(dst, conv(flat[src]) if conv else flat[src], src)
        except Unsupported as e:
            out.unsupported[src] = str(e)


def _leftovers(flat: dict, out: Imported, used: set[str], same: dict, reasons: dict[str, str], generic: str) -> None:
    """Keys no rule took: ignored where the value means what dgrpo does anyway, else unsupported."""
    for key, v in flat.items():
        if key in used or key in out.unsupported:
            continue
        if key in same and (same[key] is None or v in same[key]):
            out.ignored[key] = reasons.get(key, "dgrpo behaves this way already")
            continue
        prefix = next((p for p in reasons if p.endswith(".") and key.startswith(p)), None)
        reason = reasons.get(key) or (reasons[prefix] if prefix else generic)
        if v is None or (prefix and prefix in same):
            out.ignored[key] = reason
        else:
            out.unsupported[key] = reason
