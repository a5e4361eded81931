"""Huge text prompts against a real `dgrpo sampler` (vLLM on CPU): tokenizing one must not stall the server."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import ServiceProcess, free_port

from dgrpo.sampler.config import SamplerConfig
from dgrpo.v1 import sampler_pb2 as pb
from dgrpo.v1 import sampler_pb2_grpc

pytestmark = pytest.mark.slow
HUGE_CHARS = 6_000_000


def test_default_char_bound_is_16_chars_per_token_of_max_model_len():
    assert SamplerConfig(max_model_len=64).prompt_char_limit == 1024
    assert SamplerConfig(max_model_len=64, max_prompt_chars=10).prompt_char_limit == 10


def test_health_answers_while_a_huge_prompt_is_tokenized(child_processes, tiny_model):
    """The char bound raised so that a 6M-character prompt reaches the tokenizer (seconds of work): meanwhile health
    checks answer at once, and the prompt is then refused as too long for the model, naming it."""
    port = free_port()
    svc = ServiceProcess("sampler", [
        f"model.path={tiny_model}", "model.dtype=float32", f"sampler.port={port}", "sampler.host=127.0.0.1",
        "sampler.enforce_eager=true", "sampler.max_model_len=512", f"sampler.max_prompt_chars={HUGE_CHARS}",
        "sampler.shutdown_grace_s=1",
    ], port).wait_ready(timeout=300)
    try:
        channel = grpc.insecure_channel(svc.address)
        stub, health = sampler_pb2_grpc.SamplerStub(channel), health_pb2_grpc.HealthStub(channel)
        words = ("lorem ipsum dolor sit amet " * (HUGE_CHARS // 27 + 1))[:HUGE_CHARS]
        request = pb.GenerateRequest(prompts=[pb.Prompt(id="novel", text=words)],
                                     sampling=pb.SamplingParams(n=1, max_tokens=4))
        outcome: dict = {}

        def call():
            t0 = time.monotonic()
            try:
                list(stub.Generate(request, timeout=300))
            except grpc.RpcError as e:
                outcome.update(code=e.code(), details=e.details())
            outcome["seconds"] = time.monotonic() - t0

        caller = threading.Thread(target=call)
        caller.start()
        time.sleep(0.3)  # the request is in (6 MB over loopback) and being tokenized
        waits = []
        while caller.is_alive() and len(waits) < 50:
            t0 = time.monotonic()
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            waits.append(time.monotonic() - t0)
            time.sleep(0.05)
        caller.join(300)
        assert outcome["code"] == grpc.StatusCode.INVALID_ARGUMENT and "'novel'" in outcome["details"]
        assert len(waits) >= 3, f"tokenizing took only {outcome['seconds']:.2f}s: too quick to show anything"
        # Blocked, a health check would wait for the whole tokenization (48 s for 40 MB before it moved off the
        # event loop); served, it waits for the scheduler only (ms; up to ~1 s on a machine under load).
        assert max(waits) < min(2.0, outcome["seconds"] / 3), (
            f"health checks waited up to {max(waits):.2f}s while a prompt was tokenized for {outcome['seconds']:.1f}s")
        channel.close()
    finally:
        svc.stop()
