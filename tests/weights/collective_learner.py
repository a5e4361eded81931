"""The learner's side of the weight channel in its own process, for tests across simulated hosts
(tests/weights/test_collective.py): a `WeightPublisher` driven by JSON lines on stdin, reporting JSON events.

    python collective_learner.py --config '<WeightSyncConfig JSON>' --shapes '{"name": [rows, cols], ...}'
    python collective_learner.py --config '<WeightSyncConfig JSON>' --model <HF folder>   # its weights, perturbed
    stdin:  {"publish": 3}                     -> {"event": "published", "version": 3, "nbytes": ..., "digests": {...}}
            {"wait_hosts": 3, "timeout": 30}   -> {"event": "hosts", "hosts": {...}} once every host acknowledged 3
                                                  (or the timeout passed; "hosts" says what each host has)
            {"shm_digests": 3}                 -> {"event": "shm_digests", ...}: the same version through the shm
                                                  path (a publisher with weights.transport=shm), its manifest checksums
    a line "stop" or the end of stdin: close the publisher and exit 0.

Published tensors hold small integers (exact in bf16), so a replica's per-tensor sums name the version it holds;
with --model, the model's fp32 weights plus 0.05 x N(0, 1) noise seeded by the version (for real vLLM replicas).
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import time

import torch

from dgrpo.weights.config import WeightSyncConfig
from dgrpo.weights.publisher import WeightPublisher


def integer_weights(shapes: dict[str, list[int]], version: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(version)
    return {name: torch.randint(-100, 100, shape, generator=gen).float() for name, shape in shapes.items()}


def model_weights(path: str):
    from transformers import AutoModelForCausalLM

    base = {k: v.detach().clone() for k, v in AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            .state_dict().items()}

    def make(version: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(version)
        return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in base.items()}

    return make


def sums_of(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    return {name: float(t.to(torch.bfloat16).double().sum()) for name, t in tensors.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def hosts_of(pub: WeightPublisher) -> dict:
    return {key: {"name": h.name, "acked": h.acked, "joins": h.joins, "failures": h.failures}
            for key, h in pub.hosts.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--shapes", default="{}")
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    cfg = WeightSyncConfig.model_validate_json(args.config)
    shapes = json.loads(args.shapes)
    make = (lambda v: integer_weights(shapes, v)) if args.model is None else model_weights(args.model)
    with WeightPublisher(cfg, "hosts", dtype="bfloat16") as pub:
        emit("ready")
        for line in sys.stdin:
            if line.strip() == "stop":
                break
            command = json.loads(line)
            if "publish" in command:
                version = command["publish"]
                tensors = make(version)
                stats = pub.publish(iter(tensors.items()), version)
                emit("published", version=version, nbytes=stats.nbytes, sums=sums_of(tensors),
                     digests={t.name: t.xxh3 for t in pub.latest.manifest.tensors})
            elif "wait_hosts" in command:
                deadline = time.monotonic() + command.get("timeout", 30)
                while time.monotonic() < deadline and not (
                        pub.hosts and all(h.acked >= command["wait_hosts"] for h in pub.hosts.values())):
                    time.sleep(0.01)
                emit("hosts", hosts=hosts_of(pub))
            elif "shm_digests" in command:
                shm = WeightSyncConfig(transport="shm", announce_port=free_port(), control_port=free_port())
                with WeightPublisher(shm, "hosts", dtype="bfloat16") as local:
                    tensors = make(command["shm_digests"])
                    local.publish(list(tensors.items()), command["shm_digests"])
                    emit("shm_digests", digests={t.name: t.xxh3 for t in local.latest.manifest.tensors})
    return 0


if __name__ == "__main__":
    sys.exit(main())
