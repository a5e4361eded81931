"""Container health probe: exit 0 when the gRPC health service at localhost:PORT answers SERVING, else 1.

Docker's HEALTHCHECK (and compose `healthcheck:`) run it inside the container:
`python /opt/dgrpo/deploy/healthcheck.py 50051`. It uses the standard grpc.health.v1 service every dgrpo service
serves, so it reports exactly what `grpc_health_probe` or a Kubernetes gRPC probe would: a sampler still loading
its engine, or one shutting down, answers NOT_SERVING and is not sent work. Only grpcio and grpcio-health-checking
are imported (about 0.2 s), never torch or vLLM.
"""

from __future__ import annotations

import sys


def check(target: str, service: str = "", timeout_s: float = 3.0) -> tuple[bool, str]:
    """(serving?, what was seen) for the health service at `target` (host:port)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as e:
            return False, f"{target}: {e.code().name} {e.details() or ''}".strip()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, f"{target}: {status}"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: healthcheck.py PORT|HOST:PORT [SERVICE]", file=sys.stderr)
        return 2
    target = argv[0] if ":" in argv[0] else f"localhost:{argv[0]}"
    ok, seen = check(target, argv[1] if len(argv) > 1 else "")
    print(seen)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
