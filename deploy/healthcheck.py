"""Container health probe: exit 0 when the gRPC health service at localhost:PORT answers SERVING, else 1.

Docker's HEALTHCHECK (and compose `healthcheck:`) run it inside the container:
`python /opt/dgrpo/deploy/healthcheck.py 50051`. It uses the standard grpc.health.v1 service every dgrpo service
serves, so it reports exactly what `grpc_health_probe` or a Kubernetes gRPC probe would: a sampler still loading
its engine, or one shutting down, answers NOT_SERVING and is not sent work. Only grpcio and grpcio-health-checking
are imported (about 0.2 s), never torch or vLLM (nor dgrpo's config: a service's TLS files are given as flags).

With `auth.tls` on, health answers over TLS only: pass `--ca-file` (the service's auth.tls.ca_file), and for
mutual TLS also `--cert-file` / `--key-file` (the service's own pair will do); `--server-name` when the
certificate does not name localhost. Health needs no token.
"""

from __future__ import annotations

import argparse
import sys


def check(target: str, service: str = "", timeout_s: float = 3.0, *, ca_file: str | None = None,
          cert_file: str | None = None, key_file: str | None = None,
          server_name: str | None = None) -> tuple[bool, str]:
    """(serving?, what was seen) for the health service at `target` (host:port); TLS when `ca_file` is given."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if ca_file is None:
        channel = grpc.insecure_channel(target)
    else:
        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        credentials = grpc.ssl_channel_credentials(read(ca_file), read(key_file), read(cert_file))
        options = [] if server_name is None else [("grpc.ssl_target_name_override", server_name)]
        channel = grpc.secure_channel(target, credentials, options=options)
    with channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as e:
            return False, f"{target}: {e.code().name} {e.details() or ''}".strip()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, f"{target}: {status}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="healthcheck.py", description="exit 0 when gRPC health answers SERVING")
    parser.add_argument("target", metavar="PORT|HOST:PORT")
    parser.add_argument("service", nargs="?", default="", help="one service's health (default: the server's)")
    parser.add_argument("--ca-file", help="TLS: the PEM CA that signed the server's certificate (auth.tls.ca_file)")
    parser.add_argument("--cert-file", help="mutual TLS: a PEM client certificate signed by that CA")
    parser.add_argument("--key-file", help="mutual TLS: the PEM private key of --cert-file")
    parser.add_argument("--server-name", help="TLS: the name expected in the server's certificate")
    args = parser.parse_args(argv)
    if (args.cert_file is None) != (args.key_file is None):
        parser.error("--cert-file and --key-file go together")
    if args.ca_file is None and (args.cert_file or args.server_name):
        parser.error("--cert-file, --key-file and --server-name need --ca-file (TLS)")
    target = args.target if ":" in args.target else f"localhost:{args.target}"
    try:
        ok, seen = check(target, args.service, ca_file=args.ca_file, cert_file=args.cert_file,
                         key_file=args.key_file, server_name=args.server_name)
    except OSError as e:
        print(f"{target}: cannot read {e.filename}: {e.strerror}")
        return 1
    print(seen)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
