"""`dgrpo rewarder` as a real process: health (NOT_SERVING while loading), reflection, Score, errors, Info,
Reload, SIGHUP re-reading the spec file, Prometheus metrics, graceful SIGTERM."""

from __future__ import annotations

import signal
import time
import urllib.request

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from dgrpo.learner.rollout.reward_client import score_group
from dgrpo.v1 import rewarder_pb2 as pb
from dgrpo.v1 import rewarder_pb2_grpc

pytestmark = pytest.mark.slow

SLOW_IMPORT = '''
import time
time.sleep(2)  # a slow load: the service must answer NOT_SERVING meanwhile


def reward_func(prompts, completions, answer, **kwargs):
    return [1.0 if str(a) in c else 0.0 for c, a in zip(completions, answer)]
'''


def _spec(weight: float) -> dict:
    return {"name": "trl", "functions": [{"type": "file", "path": "PATH", "weight": weight}, {"type": "math_verify"}]}


def _first_health_answer(address: str, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    # Short reconnect backoff: the default grows to seconds and could step over the NOT_SERVING window.
    options = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.max_reconnect_backoff_ms", 100)]
    with grpc.insecure_channel(address, options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                return stub.Check(health_pb2.HealthCheckRequest(service="dgrpo.v1.Rewarder"), timeout=1).status
            except grpc.RpcError:
                time.sleep(0.05)
    raise TimeoutError(f"no health answer from {address}")


def test_rewarder_service_end_to_end(tmp_path, service_factory, free_port):
    reward_file = tmp_path / "slow_import.py"
    reward_file.write_text(SLOW_IMPORT)
    spec_file = tmp_path / "spec.yaml"

    def write_spec(weight):
        spec = _spec(weight)
        spec["functions"][0]["path"] = str(reward_file)
        spec_file.write_text(yaml.safe_dump(spec))

    write_spec(1.0)
    port, metrics_port = free_port(), free_port()
    svc = service_factory("rewarder", [
        f"rewarder.port={port}", f"rewarder.spec_file={spec_file}", "rewarder.workers=1",
        f"rewarder.metrics_port={metrics_port}",
        "rewarder.host=127.0.0.1", "rewarder.grace_s=5",
    ], port=port)
    assert _first_health_answer(svc.address) == health_pb2.HealthCheckResponse.NOT_SERVING
    svc.wait_ready(timeout=120)

    with grpc.insecure_channel(svc.address) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert {"dgrpo.v1.Rewarder", "grpc.health.v1.Health"} <= services
        stub = rewarder_pb2_grpc.RewarderStub(channel)

        request = pb.ScoreRequest(groups=[
            score_group("q1", "1+2?", ["it is 3", "it is 4"], {"answer": 3}),
            score_group("q2", [{"role": "user", "content": "2+2?"}], ["4", "\\boxed{5}"], {"answer": 4}),
        ], group_size=2)
        response = stub.Score(request, timeout=60)
        assert (response.spec.name, response.spec.version, len(response.spec.content_hash)) == ("trl", 1, 64)
        assert [g.prompt_id for g in response.groups] == ["q1", "q2"]
        first = response.groups[0].scores[0]
        assert first.status == pb.SCORE_STATUS_OK and first.reward == 2.0
        assert dict(first.breakdown) == {"reward_func": 1.0, "math_verify": 1.0}
        # A chat prompt: functions get TRL's conversational completions, so this string-matching function (written
        # for the standard format) sees message lists and scores 0; math_verify reads the content.
        assert [dict(s.breakdown) for s in response.groups[1].scores] == [
            {"reward_func": 0.0, "math_verify": 1.0}, {"reward_func": 0.0, "math_verify": 0.0}]

        for bad, message in [
            (pb.ScoreRequest(), "no groups"),
            (pb.ScoreRequest(groups=[score_group("a", "p", ["x"], {"answer": 1})], group_size=2), "group_size is 2"),
            (pb.ScoreRequest(groups=[score_group("a", "p", [], {})]), "has no completions"),
        ]:
            with pytest.raises(grpc.RpcError) as err:
                stub.Score(bad, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()

        info = stub.Info(pb.RewarderInfoRequest(), timeout=10)
        assert [(f.name, f.kind, f.weight) for f in info.functions] == [("reward_func", "file", 1.0),
                                                                       ("math_verify", "math_verify", 1.0)]
        assert info.workers_alive == 1 and info.on_error == "error" and info.spec.version == 1

        with pytest.raises(grpc.RpcError) as err:
            stub.Reload(pb.ReloadRequest(spec_text="functions: [{type: file, path: /nonexistent.py}]"), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "rewarder.allowed_dirs" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:  # inside the spec file's folder
            stub.Reload(pb.ReloadRequest(spec_text=f"functions: [{{type: file, path: {tmp_path}/missing.py}}]"),
                        timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not exist" in err.value.details()
        assert stub.Info(pb.RewarderInfoRequest(), timeout=10).spec.version == 1

        write_spec(10.0)  # edit the spec file, then SIGHUP
        svc.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 60
        while stub.Info(pb.RewarderInfoRequest(), timeout=10).spec.version != 2:
            assert time.monotonic() < deadline, svc.logs()[-3000:]
            time.sleep(0.2)
        response = stub.Score(request, timeout=60)
        assert response.spec.version == 2 and response.groups[0].scores[0].reward == 11.0

        reloaded = stub.Reload(pb.ReloadRequest(spec_text=yaml.safe_dump({"name": "len", "functions": [
            {"type": "length", "max_length": 5}]})), timeout=60)
        assert reloaded.changed and reloaded.previous.version == 2 and reloaded.spec.version == 3
        assert [s.reward for s in stub.Score(request, timeout=60).groups[0].scores] == [0.0, 0.0]

        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert 'dgrpo_rewarder_completions_total{status="ok"} 12.0' in metrics
        assert "dgrpo_rewarder_spec_version 3.0" in metrics
        assert 'dgrpo_rewarder_function_seconds_count{function="reward_func"}' in metrics

        # Graceful SIGTERM: a request running when the signal arrives still gets its scores.
        slow = tmp_path / "slow.py"
        slow.write_text("import time\ndef reward_func(prompts, completions, **kw):\n    time.sleep(2)\n"
                        "    return [0.75] * len(completions)\n")
        stub.Reload(pb.ReloadRequest(spec_text=f"functions: [{{type: file, path: {slow}}}]"), timeout=60)
        running = stub.Score.future(request, timeout=60)
        time.sleep(0.5)
        svc.proc.send_signal(signal.SIGTERM)
        assert [s.reward for s in running.result().groups[0].scores] == [0.75, 0.75]

    assert svc.proc.wait(timeout=30) == 0
    assert "rewarder stopped" in svc.logs()


def test_help_lists_the_rewarder_options(child_processes):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "dgrpo.cli", "rewarder", "--help"], check=True, capture_output=True,
                         text=True, timeout=60)
    for key in ("rewarder.spec.functions", "rewarder.spec_file", "rewarder.on_error", "rewarder.call_timeout_s"):
        assert key in out.stdout
