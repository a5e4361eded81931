"""Shared fixtures: the tiny test model, free ports, and real service processes.

Services run as real subprocesses (`python -m dgrpo.cli <command> ...`) and are awaited through the
standard gRPC health service, exactly as docker and `dgrpo up` see them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings
from support import ServiceProcess, free_port

# The tiers (unit / integration / e2e), decided from the fixtures a test requests, and their guard and time limits;
# the services several modules share in one session (`shared_replicas`).
pytest_plugins = ["tiers", "shared_services"]

# Property tests draw the same examples on every CI run (a failure there is reproducible, never a lucky draw);
# a developer's run explores new ones. `CI` is set by .ci/run.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

TINY_MODEL_DIR = Path(os.environ.get("DGRPO_CACHE", Path.home() / ".cache" / "dgrpo")) / "models" / "tiny-llama-h64"


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer (fp32): seconds to load in vLLM and transformers."""
    from dgrpo.common.models import make_tiny_model

    return make_tiny_model(TINY_MODEL_DIR)


@pytest.fixture(scope="session")
def bundled_model() -> Path:
    from dgrpo.common.models import prepare_bundled_model

    return prepare_bundled_model()


@pytest.fixture
def service_factory(child_processes):
    """Start services with `start(command, overrides, port)`; all are stopped at teardown."""
    started: list[ServiceProcess] = []

    def start(command: str, overrides: list[str], port: int | None = None, env: dict | None = None) -> ServiceProcess:
        svc = ServiceProcess(command, overrides, port or free_port(), env)
        started.append(svc)
        return svc

    yield start
    for svc in started:
        svc.stop(timeout=30)


@pytest.fixture(name="free_port")
def free_port_fixture():
    return free_port
