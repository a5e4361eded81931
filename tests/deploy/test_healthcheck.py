"""deploy/healthcheck.py, the containers' health probe, against a real gRPC health service in this process."""

from __future__ import annotations

import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

PROBE = Path(__file__).resolve().parents[2] / "deploy" / "healthcheck.py"


def probe(port: int, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PROBE), str(port), *extra], capture_output=True, text=True, timeout=60,
                          check=False)


def test_probe_follows_the_serving_status(child_processes, free_port):
    port = free_port()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        loading = probe(port)
        assert loading.returncode == 1 and "NOT_SERVING" in loading.stdout

        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        ready = probe(port)
        assert ready.returncode == 0 and "SERVING" in ready.stdout

        unknown = probe(port, "dgrpo.v1.NoSuchService")
        assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stdout
    finally:
        server.stop(0)
    gone = probe(port)
    assert gone.returncode == 1 and "UNAVAILABLE" in gone.stdout


def test_probe_usage_error(child_processes):
    assert subprocess.run([sys.executable, str(PROBE)], capture_output=True, timeout=30, check=False).returncode == 2


def test_probe_tls_flags_are_checked(child_processes, free_port, tmp_path):
    """TLS over a real server is tested in tests/test_tls.py; here the flags that cannot work are refused."""
    port = free_port()
    lone_cert = probe(port, "--ca-file", "ca.pem", "--cert-file", "client.pem")
    assert lone_cert.returncode == 2 and "--cert-file and --key-file go together" in lone_cert.stderr
    no_ca = probe(port, "--server-name", "rewarder")
    assert no_ca.returncode == 2 and "need --ca-file" in no_ca.stderr
    missing = probe(port, "--ca-file", str(tmp_path / "missing.pem"))
    assert missing.returncode == 1 and "cannot read" in missing.stdout and "missing.pem" in missing.stdout
