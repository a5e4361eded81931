"""The compose runs need a Docker daemon and the CPU image: built once per session by deploy/build.sh (cached)."""

from __future__ import annotations

import sys

import pytest
from compose_support import DEPLOY, docker_problem, run, sweep_stale_test_objects


@pytest.fixture(scope="session")
def docker_ready(launcher):
    """Skips (printing why) without a daemon; else builds dgrpo:cpu as a user would (a warm build takes seconds)."""
    problem = docker_problem()
    if problem:
        print(f"\n[compose] SKIPPED, no compose run: {problem}", file=sys.stderr)
        pytest.skip(problem)
    stale = sweep_stale_test_objects()
    if stale:
        print(f"\n[compose] removed {len(stale)} objects a killed earlier test run left: {stale}", file=sys.stderr)
    build = run(["bash", str(DEPLOY / "build.sh"), "cpu"], timeout=5400)
    print("\n".join(line for line in build.stdout.splitlines() if line.startswith("[build]")))
