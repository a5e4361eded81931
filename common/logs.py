"""One log format for every service, so `dgrpo up` can prefix and interleave them readably."""

from __future__ import annotations

import logging
import os


def setup_logging(service: str, level: str | None = None) -> logging.Logger:
    level = level or os.environ.get("DGRPO_LOG_LEVEL", "INFO")
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s [{service}] %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    return logging.getLogger(f"dgrpo.{service}")
