"""Shared by the learner-loop tests (lockstep and asynchronous) that run real samplers and a rewarder."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
from support import ServiceProcess

from dgrpo.cli.up import stable_free_port
from dgrpo.v1 import sampler_pb2, sampler_pb2_grpc

REWARD_FNS = Path(__file__).parent / "learner" / "reward_fns.py"
REWARD_SPEC = f"rewarder.spec={{name: test, functions: [{{type: file, path: {REWARD_FNS}, function: char_diversity}}]}}"


def fixed_port() -> int:
    """A free port the engines' own bind(0) calls cannot take before the learner binds it (dgrpo up's choice)."""
    return stable_free_port()


def start_rewarder(port: int) -> ServiceProcess:
    return ServiceProcess("rewarder", [f"rewarder.port={port}", "rewarder.host=127.0.0.1", "rewarder.workers=1",
                                       REWARD_SPEC], port)


def sampler_info(address: str) -> sampler_pb2.SamplerInfo:
    """The replica's Info: its weight version, the requests its engine runs now, ..."""
    with grpc.insecure_channel(address) as ch:
        return sampler_pb2_grpc.SamplerStub(ch).Info(sampler_pb2.InfoRequest(), timeout=10)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
