"""The shared gRPC bootstrap over real channels: health NOT_SERVING -> SERVING, reflection, interceptors, a taken
port failing with the config key, and the SIGTERM stop sequence (called directly, and by a real signal)."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import textwrap

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from support import wait_serving

from dgrpo.common.grpc_server import BindError, GrpcServer, create_server
from dgrpo.learner.records.control import SERVICE_NAME, LearnerServicer, LoopState
from dgrpo.v1 import learner_pb2, learner_pb2_grpc

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def make_server(port: int = 0, **kw) -> GrpcServer:
    return create_server(LearnerServicer(LoopState(step=7)), learner_pb2_grpc.add_LearnerServicer_to_server,
                         SERVICE_NAME, host="127.0.0.1", port=port, config_key="test.port", **kw)


async def health(port: int) -> tuple[int, int]:
    """(whole server, the service) health, on a fresh channel."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        whole = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        service = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
        return whole.status, service.status


def reflected_services(port: int) -> set[str]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return set(ProtoReflectionDescriptorDatabase(channel).get_services())


def test_health_starts_not_serving_until_the_service_says_so_and_reflection_lists_it():
    async def scenario():
        server = make_server()
        assert server.port > 0
        await server.start()
        try:
            before = await health(server.port)
            await server.set_serving(True)
            after = await health(server.port)
            services = await asyncio.to_thread(reflected_services, server.port)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                status = await learner_pb2_grpc.LearnerStub(channel).Status(learner_pb2.StatusRequest(), timeout=5)
        finally:
            await server.stop(0)
        return before, after, services, status.step

    before, after, services, step = asyncio.run(scenario())
    assert before == (NOT_SERVING, NOT_SERVING)
    assert after == (SERVING, SERVING)
    assert {SERVICE_NAME, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
    assert step == 7  # the servicer is registered and answers


def test_bind_to_a_taken_port_names_the_config_key_and_the_address():
    async def scenario():
        with socket.socket() as held:  # a plain listener, and below a running gRPC server (SO_REUSEPORT is off)
            held.bind(("127.0.0.1", 0))
            held.listen()
            port = held.getsockname()[1]
            with pytest.raises(BindError) as by_socket:
                make_server(port)
        first = make_server()
        await first.start()
        try:
            with pytest.raises(BindError) as by_server:
                make_server(first.port)
        finally:
            await first.stop(0)
        with pytest.raises(BindError) as foreign:  # not an address of this host
            create_server(LearnerServicer(LoopState()), learner_pb2_grpc.add_LearnerServicer_to_server, SERVICE_NAME,
                          host="203.0.113.1", port=0, config_key="test.port")
        return port, by_socket.value, first.port, by_server.value, foreign.value

    port, by_socket, grpc_port, by_server, foreign = asyncio.run(scenario())
    assert f"127.0.0.1:{port} (test.port={port})" in str(by_socket)
    assert f"127.0.0.1:{grpc_port} (test.port={grpc_port})" in str(by_server)
    assert "203.0.113.1:0 (test.port=0)" in str(foreign)


def test_stop_goes_not_serving_then_drains_then_stops_then_on_stop():
    events: list[tuple[str, object]] = []

    async def scenario():
        server = make_server()
        await server.start()
        await server.set_serving(True)
        port = server.port

        async def drain():
            events.append(("drain: health", await health(port)))  # still answering, but NOT_SERVING

        async def on_stop():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                try:
                    await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
                    events.append(("on_stop: call", "answered"))
                except grpc.aio.AioRpcError as e:
                    events.append(("on_stop: call", e.code()))

        await server.stop(0.5, drain=drain, on_stop=on_stop)

    asyncio.run(scenario())
    assert events == [("drain: health", (NOT_SERVING, NOT_SERVING)), ("on_stop: call", grpc.StatusCode.UNAVAILABLE)]


def test_interceptors_see_every_call():
    seen: list[str] = []

    class Record(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation, handler_call_details):
            seen.append(handler_call_details.method)
            return await continuation(handler_call_details)

    async def scenario():
        server = make_server(interceptors=[Record()])
        await server.start()
        try:
            await health(server.port)
        finally:
            await server.stop(0)

    asyncio.run(scenario())
    assert seen == ["/grpc.health.v1.Health/Check"] * 2


SIGTERM_SCRIPT = textwrap.dedent('''
    import asyncio, sys
    from dgrpo.common.grpc_server import create_server, serve_until_signal
    from dgrpo.learner.records.control import SERVICE_NAME, LearnerServicer, LoopState
    from dgrpo.v1 import learner_pb2_grpc

    async def main():
        server = create_server(LearnerServicer(LoopState()), learner_pb2_grpc.add_LearnerServicer_to_server,
                               SERVICE_NAME, host="127.0.0.1", port=int(sys.argv[1]), config_key="test.port")
        await server.start()
        await server.set_serving(True)
        print("serving", flush=True)

        async def drain():
            print("drained", flush=True)

        async def on_stop():
            print("stopped", flush=True)

        await serve_until_signal(server, grace=1.0, drain=drain, on_stop=on_stop)

    asyncio.run(main())
''')


def test_sigterm_runs_the_stop_sequence_and_exits_cleanly(child_processes, free_port):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_SCRIPT, str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_serving(f"127.0.0.1:{port}", timeout=60, proc=proc, service=SERVICE_NAME)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert out.split() == ["serving", "drained", "stopped"]
