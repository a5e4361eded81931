"""Training across two simulated hosts (tests/hosts_support.py): `dgrpo learner` in host a; the rewarder and two
`dgrpo sampler` replicas in host b, with no /dev/shm in common. Weights cross with weights.transport=collective, once
per version, to the replica that relays for host b; gRPC (prompts, groups, rewards) crosses the same veth.

4 steps: every version reaches both replicas, each loads exactly the manifest the learner published for it (names,
shapes and every tensor's xxh3: the bytes the shm path would deliver), and the learner logs one transfer per version
to the host."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
import yaml
from hosts_support import EventProcess, TwoHosts, available
from loop_support import REWARD_SPEC, read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.skipif(available() is not None, reason=str(available()))]
STEPS = 4


def service(hosts: TwoHosts, command: str, overrides: list[str], log: Path) -> EventProcess:
    return EventProcess(hosts.b.command([sys.executable, "-m", "dgrpo.cli", command, *overrides]), log, events=False)


def wait_ready(proc: EventProcess, marker: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while marker not in proc.logs():
        if proc.proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{proc.log_path.name} not ready:\n{proc.logs()[-5000:]}")
        time.sleep(0.5)


def manifests(log: str, pattern: str) -> dict[int, str]:
    return {int(v): m for v, m in re.findall(pattern, log)}


def test_four_steps_with_samplers_on_another_host(launcher, tiny_model, tmp_path):
    with TwoHosts("loop") as hosts:
        a, b = hosts.a.address, hosts.b.address
        weights = ["weights.transport=collective", f"weights.host={a}", "weights.collective_timeout_s=20",
                   "weights.catch_up_timeout_s=30"]
        rewarder = service(hosts, "rewarder", ["rewarder.port=50052", f"rewarder.host={b}", "rewarder.workers=1",
                                               REWARD_SPEC], tmp_path / "rewarder.log")
        samplers = [service(hosts, "sampler", [
            f"model.path={tiny_model}", "model.dtype=float32", f"sampler.port={port}", f"sampler.host={b}",
            "sampler.enforce_eager=true", "sampler.max_model_len=512", f"sampler.replica_id=r{i}",
            "sampler.shutdown_grace_s=1", *weights], tmp_path / f"sampler-{i}.log")
            for i, port in enumerate((50061, 50062))]
        procs = [rewarder, *samplers]
        try:
            wait_ready(rewarder, "rewarder SERVING")
            for proc in samplers:
                wait_ready(proc, "DGRPO_READY")
            rows = [{"prompt": f"What is {x}+{y}?", "answer": str(x + y)} for x in range(4) for y in range(4)]
            (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            config = {
                "model": {"path": str(tiny_model), "dtype": "float32"},
                "sampler": {"addresses": [f"{b}:50061", f"{b}:50062"], "max_model_len": 512},
                "weights": {"transport": "collective", "host": a, "bind_host": a, "collective_timeout_s": 20},
                "learner": {
                    "data": {"train_files": [str(tmp_path / "train.jsonl")], "train_batch_size": 2,
                             "max_prompt_length": 64},
                    "rollout": {"n": 4, "max_response_length": 16, "seed": 3, "rewarder_address": f"{b}:50052"},
                    "actor": {"ppo_mini_batch_size": 2, "micro_batch_size_per_device": 8, "dtype": "float32",
                              "compute_entropy": False},
                    "optim": {"lr": 1e-3},
                    "checkpoint": {"save_freq": 0},
                    "trainer": {"total_training_steps": STEPS, "control_port": 0, "run_name": "hosts",
                                "log_dir": str(tmp_path / "runs")},
                },
            }
            (tmp_path / "stack.yaml").write_text(yaml.safe_dump(config))
            learner = EventProcess(hosts.a.command([sys.executable, "-m", "dgrpo.cli", "learner", "--config",
                                                    str(tmp_path / "stack.yaml")]), tmp_path / "learner.log",
                                   events=False)
            procs.append(learner)
            assert learner.proc.wait(900) == 0, learner.logs()[-6000:]
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.stop(60)
    steps = [r for r in read_jsonl(tmp_path / "runs" / "hosts" / "metrics.jsonl") if "actor/loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert [r["weights/version"] for r in steps] == [float(s) for s in range(1, STEPS + 1)]
    learner_log = learner.logs()
    published = manifests(learner_log, r"published weights v(\d+) .*manifest ([0-9a-f]{16})")
    assert sorted(published) == list(range(1, STEPS + 1))
    for sampler in samplers:
        loaded = manifests(sampler.logs(), r"loaded weight version (\d+) .*manifest ([0-9a-f]{16})")
        # A replica that is behind loads the newest version, skipping others: each one it loads is the learner's.
        assert loaded and all(published[v] == m for v, m in loaded.items()), (sampler.log_path, loaded)
        assert STEPS in loaded, sampler.log_path
    sent = re.findall(r"weights: host .* has version (\d+)", learner_log)
    assert sorted(map(int, sent)) == list(range(1, STEPS + 1))  # once per version to the host, not per replica
