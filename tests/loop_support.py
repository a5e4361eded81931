"""Shared by the learner-loop tests (lockstep and asynchronous) that run real samplers and a rewarder."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
from support import ServiceProcess, free_port

from dgrpo.cli.launch.up import stable_free_port
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


@contextmanager
def replicas_and_rewarder(tiny_model: Path, replicas: int = 2, **weights: object,
                          ) -> Iterator[tuple[list[ServiceProcess], ServiceProcess, dict]]:
    """Sampler replicas subscribed to weight sync on fixed ports, and a rewarder; started in parallel, stopped at
    exit. Yields (samplers, rewarder, the stack config's `weights` section); `weights` adds keys to that section."""
    weights = {"announce_port": fixed_port(), "control_port": fixed_port(), **weights}
    weight_args = [f"weights.{key}={value}" for key, value in weights.items()]
    samplers = [
        ServiceProcess("sampler", [f"model.path={tiny_model}", "model.dtype=float32", f"sampler.port={port}",
                                   "sampler.host=127.0.0.1", "sampler.enforce_eager=true", "sampler.max_model_len=512",
                                   f"sampler.replica_id=r{i}", "sampler.shutdown_grace_s=1", *weight_args], port)
        for i, port in enumerate([free_port() for _ in range(replicas)])
    ]
    rewarder = start_rewarder(free_port())
    try:
        for svc in [rewarder, *samplers]:
            svc.wait_ready(timeout=400)
        yield samplers, rewarder, weights
    finally:
        for svc in [rewarder, *samplers]:  # SIGTERM all first: they shut down in parallel
            if svc.proc.poll() is None:
                svc.proc.terminate()
        for svc in [rewarder, *samplers]:
            svc.stop(timeout=30)


def write_sums(root: Path, operands: int) -> dict:
    """Train and validation files of "What is a+b?" for a, b < operands; returns their `learner.data` keys."""
    rows = [{"prompt": f"What is {a}+{b}?", "answer": str(a + b)} for a in range(operands) for b in range(operands)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    return {"train_files": [str(root / "train.jsonl")], "val_files": [str(root / "val.jsonl")]}
