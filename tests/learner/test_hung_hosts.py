"""A partition between hosts never stalls the rollout: two simulated hosts (tests/hosts_support.py), sampler r0 and
the learner's rollout client (tests/learner/rollout_peer.py) in host a, sampler r1 in host b. Host b starts dropping
every packet on its link while r1 holds prompts (iptables DROP: no reset, no error, the link up, as a dead switch
port looks) and keeps dropping them for PARTITION_S seconds.

Claimed, from the client's own RolloutStats and the groups it yields: the batch cut by the partition completes on
r0 while the partition lasts, every prompt's group exactly once; r1 is marked unhealthy; a second batch runs on r0
alone, still during the partition (training goes on at one replica's speed); once the packets flow again r1
answers and serves groups of the next batch."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest
from hosts_support import EventProcess, TwoHosts, available

pytestmark = [pytest.mark.slow, pytest.mark.skipif(available() is not None, reason=str(available()))]
PARTITION_S = 60.0
PEER = Path(__file__).with_name("rollout_peer.py")
# The learner's rollout settings with quick detection for the test (a peer silent for 5 + 5 s is dropped) and no
# hedging, so that only the partition's detection moves prompts.
CONFIG = {"keepalive_s": 5.0, "keepalive_timeout_s": 5.0, "retry_backoff_s": 0.2, "max_backoff_s": 1.0,
          "probe_timeout_s": 2.0, "step_timeout_s": 300.0, "progress_timeout_s": 120.0, "hedge_after_s": None}


def sampler(host_command, tiny_model: Path, host: str, port: int, replica: str, log: Path) -> EventProcess:
    return EventProcess(host_command([
        sys.executable, "-m", "dgrpo.cli", "sampler", f"model.path={tiny_model}", "model.dtype=float32",
        f"sampler.port={port}", f"sampler.host={host}", "sampler.enforce_eager=true", "sampler.max_model_len=512",
        f"sampler.replica_id={replica}", "sampler.shutdown_grace_s=1", "weights.enabled=false"]), log, events=False)


def wait_ready(proc: EventProcess, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while "DGRPO_READY" not in proc.logs():
        if proc.proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{proc.log_path.name} not ready:\n{proc.logs()[-5000:]}")
        time.sleep(0.5)


def assert_each_once(event: dict, tag: str, n: int) -> None:
    assert sorted(event["prompt_ids"]) == sorted(f"{tag}-{i}" for i in range(n)), event


@pytest.mark.skipif(shutil.which("iptables") is None, reason="iptables drops the partitioned host's packets")
def test_a_partitioned_host_is_left_while_it_drops_packets_and_used_again_once_they_flow(launcher, tiny_model,
                                                                                          tmp_path):
    with TwoHosts("partition") as hosts:
        a_address, b_address = "127.0.0.1:50071", f"{hosts.b.address}:50072"
        procs = [sampler(hosts.a.command, tiny_model, "127.0.0.1", 50071, "r0", tmp_path / "sampler-a.log"),
                 sampler(hosts.b.command, tiny_model, hosts.b.address, 50072, "r1", tmp_path / "sampler-b.log")]
        try:
            for proc in procs:
                wait_ready(proc)
            client = EventProcess(hosts.a.command([
                sys.executable, str(PEER), "--addresses", json.dumps([a_address, b_address]),
                "--config", json.dumps(CONFIG)]), tmp_path / "client.log")
            procs.append(client)

            client.send({"do": "collect", "tag": "cut", "prompts": 8, "max_tokens": 256, "holding": b_address})
            client.wait_for("holding", timeout=300)
            hosts.drop_packets(on=True)
            cut_at = time.monotonic()
            try:
                cut = client.wait_for("collected", timeout=PARTITION_S, tag="cut")
                assert_each_once(cut, "cut", 8)
                assert cut["unhealthy"] == [b_address] and cut["failed_calls"] + cut["stuck_calls"] >= 1, cut
                assert cut["groups_by_replica"].get("r0", 0) >= 1, cut

                client.send({"do": "collect", "tag": "during", "prompts": 4, "max_tokens": 16})
                during = client.wait_for("collected", timeout=PARTITION_S, tag="during")
                assert_each_once(during, "during", 4)
                assert during["groups_by_replica"] == {"r0": 4}, during
                assert time.monotonic() - cut_at < PARTITION_S, "both batches had to finish while r1 was cut off"
                time.sleep(max(0.0, PARTITION_S - (time.monotonic() - cut_at)))
            finally:
                hosts.drop_packets(on=False)

            client.send({"do": "wait_answering", "address": b_address})
            client.wait_for("answering", timeout=150)
            client.send({"do": "collect", "tag": "healed", "prompts": 8, "max_tokens": 16})
            healed = client.wait_for("collected", timeout=300, tag="healed")
            assert_each_once(healed, "healed", 8)
            assert set(healed["groups_by_replica"]) == {"r0", "r1"}, healed
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.stop(60)
