"""Which step_<N> folders under learner.checkpoint.dir are complete checkpoints, without importing torch: the
learner resumes from the newest (learner/records/checkpoint.py), and `dgrpo up` names it when it restarts a crashed
learner (cli/launch/exits.py)."""

from __future__ import annotations

import re
from pathlib import Path

STEP_DIR = re.compile(r"^step_(\d+)$")


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found) if (p / "meta.json").is_file()]
