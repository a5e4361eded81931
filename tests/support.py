"""Process helpers for tests: free ports, waiting on gRPC health, `dgrpo <command>` subprocesses.

Importable from any test module (`from support import ServiceProcess`), since pytest puts tests/ on the path.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


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
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        # The child writes through its own copy of the descriptor; ours closes once it is started.
        with tempfile.NamedTemporaryFile(prefix=f"dgrpo-{command}-", suffix=".log", delete=False) as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dgrpo.cli", command, *overrides],
                stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True,
            )
        self.log_path = Path(log.name)

    def wait_ready(self, timeout: float = 240) -> ServiceProcess:
        try:
            wait_serving(self.address, timeout, self.proc)
        except (RuntimeError, TimeoutError):  # what wait_serving raises: exited, or not SERVING in time
            raise RuntimeError(f"{self.command} failed to start; log:\n{self.logs()[-6000:]}") from None
        return self

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

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


class LoopThread:
    """One asyncio loop in a thread, shared by a module's tests (vLLM's AsyncLLM is bound to the loop it runs on).
    `timeout`: how long `run` waits for a coroutine unless told otherwise."""

    def __init__(self, timeout: float = 120):
        self.timeout = timeout
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout if timeout is None else timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
