"""Fixtures of the fuzz suite: each service in a process of its own, started once per module, with the run's token."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from fuzz.fuzzing import TOKEN
from support import free_port, wait_serving

# ---- a learner control server in its own process -----------------------------------------------------------------

_CONTROL = """
import asyncio, sys
from dgrpo.common.auth_config import AuthConfig
from dgrpo.learner.records.control import LoopState, start_control_server

async def main():
    auth = AuthConfig()  # DGRPO_TOKEN, as the learner reads it
    creds = {"credentials": auth.credentials()} if hasattr(auth, "credentials") else {"token": auth.token()}
    server = await start_control_server(LoopState(step=7, total_steps=100, phase="training", metrics={"loss": 0.5}),
                               "127.0.0.1", int(sys.argv[1]), **creds)
    await asyncio.Event().wait()  # `server` stays referenced: a collected grpc.aio server stops

asyncio.run(main())
"""


@dataclass
class Served:
    address: str
    proc: subprocess.Popen
    log_path: Path


@pytest.fixture(scope="module")
def learner_control(child_processes):
    """`start_control_server` (what the learner loop runs) in a process of its own, with the token."""
    port = free_port()
    with tempfile.NamedTemporaryFile(prefix="dgrpo-fuzz-learner-", suffix=".log", delete=False) as log:
        proc = subprocess.Popen([sys.executable, "-c", _CONTROL, str(port)], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "DGRPO_TOKEN": TOKEN}, start_new_session=True)
    served = Served(f"127.0.0.1:{port}", proc, Path(log.name))
    try:
        wait_serving(served.address, 60, proc)
    except (RuntimeError, TimeoutError):
        proc.kill()
        raise RuntimeError(f"learner control failed to start:\n{served.log_path.read_text()[-4000:]}") from None
    yield served
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
