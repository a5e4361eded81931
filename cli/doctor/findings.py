"""What one check found: OK, WARN or FAIL, with its fix in one line."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

Status = Literal["OK", "WARN", "FAIL"]


@dataclass
class Finding:
    """One check's outcome; `fix` is one line saying what to do (empty when OK)."""

    service: str
    check: str
    status: Status
    detail: str
    fix: str = ""

    def line(self) -> str:
        return f"{self.status:<4} {self.service:<8} {self.check:<16} {self.detail}" + (
            f"\n     fix: {self.fix}" if self.fix else "")

    def as_dict(self) -> dict[str, str]:
        return asdict(self)
