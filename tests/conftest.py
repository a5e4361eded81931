"""Shared fixtures: the tiny test model, free ports, and real service processes.

Services run as real subprocesses (`python -m dgrpo.cli <command> ...`) and are awaited through the
standard gRPC health service, exactly as docker and `dgrpo up` see them.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

TINY_MODEL_DIR = Path(os.environ.get("DGRPO_CACHE", Path.home() / ".cache" / "dgrpo")) / "models" / "tiny-llama-test"


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer (fp32): seconds to load in vLLM and transformers."""
    from dgrpo.common.models import make_tiny_model

    return make_tiny_model(TINY_MODEL_DIR)


@pytest.fixture(scope="session")
def bundled_model() -> Path:
    from dgrpo.common.models import prepare_bundled_model

    return prepare_bundled_model()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(address: str, timeout: float, proc: subprocess.Popen | None = None, service: str = "") -> None:
    """Block until the gRPC health service at `address` answers SERVING (or fail with the process log)."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"service at {address} exited with {proc.returncode}")
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"service at {address} not SERVING after {timeout:.0f}s")


class ServiceProcess:
    """`dgrpo <command> overrides...` as a subprocess; logs go to a temp file shown on failure."""

    def __init__(self, command: str, overrides: list[str], port: int, env: dict[str, str] | None = None):
        self.command, self.port = command, port
        self.address = f"127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"dgrpo-{command}-", suffix=".log", delete=False)
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dgrpo.cli", command, *overrides],
            stdout=self.log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True,
        )

    def wait_ready(self, timeout: float = 240) -> ServiceProcess:
        try:
            wait_serving(self.address, timeout, self.proc)
        except Exception:
            raise RuntimeError(f"{self.command} failed to start; log:\n{self.logs()[-6000:]}") from None
        return self

    def logs(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def service_factory():
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
