"""`dgrpo up`'s watch for services that hang: alive, but not answering.

A process that exits is restarted by the supervisor; one that is frozen (stopped, swapping, deadlocked in a way
that stops its gRPC server) never exits. Every few seconds this thread asks each serving sampler and the rewarder
for its gRPC health (any answer, SERVING or not, counts as alive; only a probe that times out does not). The
supervisor kills a service that has not answered for `--hung-restart-s` and restarts it like one that died. The
learner does not wait for that: its keepalive and progress checks moved the prompts to the other replicas within
seconds (learner/rollout/replica_health.py); this brings the replica itself back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

PROBE_EVERY_S = 2.0
PROBE_TIMEOUT_S = 2.0


class HangWatch:
    """Since when each watched port has not answered a health probe (None while it answers)."""

    def __init__(self, channel_for: Callable[[str], object]):
        """`channel_for(address)`: a health channel (auth.health_channel with the stack's TLS)."""
        self._channel_for = channel_for
        self._ports: set[int] = set()
        self._unanswered: dict[int, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dgrpo-up-hang-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def watch(self, port: int) -> None:
        with self._lock:
            self._ports.add(port)
            self._unanswered.pop(port, None)

    def unwatch(self, port: int) -> None:
        """While a service is (re)starting: its engine may take minutes before it answers."""
        with self._lock:
            self._ports.discard(port)
            self._unanswered.pop(port, None)

    def silent_for(self, port: int) -> float:
        """Seconds since the port last answered (0 while it answers)."""
        with self._lock:
            since = self._unanswered.get(port)
        return 0.0 if since is None else time.monotonic() - since

    def _run(self) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        channels: dict[int, object] = {}
        while not self._stop.wait(PROBE_EVERY_S):
            with self._lock:
                ports = sorted(self._ports)
            for port in ports:
                if port not in channels:
                    channels[port] = self._channel_for(f"127.0.0.1:{port}")
                stub = health_pb2_grpc.HealthStub(channels[port])
                started = time.monotonic()
                try:
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S)
                    answered = True
                except grpc.RpcError as e:
                    # Refused or reset: not a hang (the process is going or coming; the supervisor sees it).
                    answered = e.code() != grpc.StatusCode.DEADLINE_EXCEEDED
                with self._lock:
                    if port not in self._ports:
                        continue
                    if answered:
                        self._unanswered.pop(port, None)
                    else:
                        self._unanswered.setdefault(port, started)
        for channel in channels.values():
            channel.close()
