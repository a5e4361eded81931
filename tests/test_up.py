"""`dgrpo up` for real: rewarder, two sampler replicas and the learner as processes, the reward swapped mid-run.

The topology users run with `docker compose --scale sampler=2`, on the tiny model for speed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import grpc
import pytest
import yaml
from up_support import SWAPPED_SPEC, up_command, wait_for

from dgrpo.v1 import rewarder_pb2, rewarder_pb2_grpc

pytestmark = pytest.mark.slow



def _our_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("dgrpo-w-up_test*")}


def test_up_two_samplers_and_a_reward_swap(tiny_model, tmp_path):
    run_dir = tmp_path / "runs" / "up_test"
    steps = 4
    args = up_command(tiny_model, tmp_path, "up_test", steps, "--samplers", "2")
    log = open(tmp_path / "up.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        stack = wait_for(lambda: (run_dir / "stack.yaml").is_file() and yaml.safe_load((run_dir / "stack.yaml")
                                                                                        .read_text()),
                          60, "dgrpo up wrote no stack.yaml", proc, tmp_path / "up.log")
        rewarder = f"127.0.0.1:{stack['rewarder']['port']}"
        metrics = run_dir / "metrics.jsonl"
        # After the first step has been scored, swap the reward specification in place.
        wait_for(lambda: metrics.is_file() and metrics.read_text().strip(), 400, "no training step finished",
                  proc, tmp_path / "up.log")
        # `up` made a token for the run (none was configured): Reload without it is refused, with it served.
        token = (run_dir / "token").read_text().strip()
        assert (run_dir / "token").stat().st_mode & 0o777 == 0o600
        with grpc.insecure_channel(rewarder) as channel:
            stub = rewarder_pb2_grpc.RewarderStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Reload(rewarder_pb2.ReloadRequest(spec_text=SWAPPED_SPEC), timeout=60)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            reply = stub.Reload(rewarder_pb2.ReloadRequest(spec_text=SWAPPED_SPEC), timeout=60,
                                metadata=[("authorization", f"Bearer {token}")])
        assert reply.spec.name == "swapped" and reply.previous.name != "swapped"
        assert proc.wait(600) == 0, (tmp_path / "up.log").read_text()[-5000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(120)
        log.close()
    output = (tmp_path / "up.log").read_text()
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert train[-1]["weights/version"] == steps
    # Both replicas loaded every published version (each logs its loads).
    for replica in ("sampler-0", "sampler-1"):
        replica_log = (run_dir / "logs" / f"{replica}.log").read_text()
        assert f"loaded weight version {steps}" in replica_log, replica
    # The swap shows in the rewarder's log and in the learner's record of which spec scored each step.
    assert "swapped" in (run_dir / "logs" / "rewarder.log").read_text()
    versions = [r["reward/spec_version_max"] for r in train]
    assert versions[0] == 1 and versions[-1] == 2 and versions == sorted(versions)
    # Report, plot, exported model; everything stopped; no weight segment left in /dev/shm.
    assert (run_dir / "report.png").stat().st_size > 10_000
    assert (tmp_path / "model" / "config.json").is_file()
    assert "mean reward, first" in output
    assert not _our_segments()
