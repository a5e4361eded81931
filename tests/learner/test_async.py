"""Asynchronous GRPO against real services: two sampler replicas (vLLM on CPU, tiny model, in-flight weight updates
with weights.pause_mode=keep), a rewarder, and learners with rollout.max_staleness >= 1.

The replicas and the rewarder are the session's shared pair (tests/shared_services.py; test_loop.py and
test_dynamic_sampling.py use the same, pause_mode=keep for all), so they may hold an earlier learner's versions:
versions are asserted relative to the newest one a replica held before the run. The last test kills a replica; the
shared fixture replaces it before the next test that uses the pair.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import yaml
from loop_support import fixed_port, read_jsonl, sampler_info, write_sums

from dgrpo.v1 import learner_pb2, learner_pb2_grpc, sampler_pb2, sampler_pb2_grpc

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def _config(_shared_replicas_session, tiny_model, tmp_path_factory):
    """This module's learner config for the shared replicas (pause_mode=keep: in-flight updates) and rewarder."""
    root = tmp_path_factory.mktemp("async")
    shared = _shared_replicas_session
    config = {
        "model": {"path": str(tiny_model), "dtype": "float32"},
        "sampler": {"addresses": shared.addresses, "max_model_len": 512},
        "weights": shared.weights,
        "learner": {
            "data": {**write_sums(root, 5), "train_batch_size": 2, "max_prompt_length": 64, "seed": 5},
            "rollout": {"n": 4, "max_response_length": 24, "seed": 3, "rewarder_address": shared.rewarder.address,
                        "max_staleness": 2},
            # A deliberately slow update (4 epochs of 2 mini-batches, micro-batches of 1) next to fast
            # sampling: the batches sampled ahead are as stale as allowed.
            "actor": {"ppo_mini_batch_size": 1, "micro_batch_size_per_device": 1, "ppo_epochs": 4,
                      "dtype": "float32", "compute_entropy": False},
            "algorithm": {"off_policy": "tis"},
            "optim": {"lr": 1e-3},
            "checkpoint": {"save_freq": 0, "keep_last": None},
            "trainer": {"total_training_steps": 4, "test_freq": 2, "control_port": 0,
                        "log_dir": str(root / "runs")},
        },
    }
    (root / "stack.yaml").write_text(yaml.safe_dump(config))
    return {"root": root, "config": root / "stack.yaml"}


@pytest.fixture
def stack(shared_replicas, _config):
    """The shared replicas (whole: one killed by an earlier test is replaced) and this module's config."""
    assert shared_replicas.weights["pause_mode"] == "keep"  # what this module's in-flight updates need
    return {**_config, "shared": shared_replicas, "samplers": shared_replicas.samplers,
            "rewarder": shared_replicas.rewarder}


def _learner(stack, run: str, *overrides: str, timeout: float = 600) -> subprocess.CompletedProcess:
    root = stack["root"]
    cmd = [sys.executable, "-m", "dgrpo.cli", "learner", "--config", str(stack["config"]),
           f"learner.checkpoint.dir={root / ('ckpt_' + run)}", f"learner.trainer.run_name={run}", *overrides]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout)


def _steps(root: Path, run: str) -> list[dict]:
    return [r for r in read_jsonl(root / "runs" / run / "metrics.jsonl") if "actor/loss" in r]


def test_staleness_never_exceeds_k_and_batches_run_ahead(stack):
    root = stack["root"]
    base = stack["shared"].fresh_run_base()
    proc = _learner(stack, "k2")
    assert proc.returncode == 0, proc.stderr[-6000:]
    steps = _steps(root, "k2")
    assert [r["step"] for r in steps] == list(range(1, 5))
    assert [r["weights/version"] for r in steps] == [float(base + i) for i in range(1, 5)]
    k = 2
    for r in steps:
        # Trained at version step-1; every completion's first version (the version loaded when the sampler
        # admitted it) is at most k behind.
        assert r["staleness/trained_version"] == base + r["step"] - 1
        assert r["staleness/trained_version"] - r["staleness/oldest_version"] <= k
        assert 0 <= r["staleness/mean"] <= r["staleness/max"] <= k
        assert r["staleness/dropped_groups"] == 0
        assert r["reward/errors"] == 0
    # The slow update let the samplers run ahead as far as allowed: from step k+1 on, samples are k versions old.
    assert max(r["staleness/max"] for r in steps) == k
    assert all(r["staleness/mean"] > 0 for r in steps[k:])
    # The off-policy correction saw the gap between behaviour and proximal policy.
    assert all("actor/sampler_logp_diff" in r for r in steps)
    # Validation ran on the current weights while batches were in flight.
    vals = [r for r in read_jsonl(root / "runs" / "k2" / "metrics.jsonl") if "val/reward_mean" in r]
    assert [r["step"] for r in vals] == [2, 4]
    for svc in stack["samplers"]:
        assert sampler_info(svc.address).weight_version == base + 4


def test_stop_then_resume_continues_the_data_order_of_the_trained_batches(stack):
    """Stop after step 2 (the batches of the next k steps in flight): the checkpoint's data position is after the
    last trained batch, so the resumed run trains the following batches exactly as the uninterrupted run did."""
    root = stack["root"]
    control = fixed_port()

    def stop_after_step_2() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{control}") as ch:
            stub = learner_pb2_grpc.LearnerStub(ch)
            deadline = time.monotonic() + 400
            while time.monotonic() < deadline:
                try:
                    status = stub.Status(learner_pb2.StatusRequest(), timeout=5)
                except grpc.RpcError:
                    time.sleep(0.2)
                    continue
                if status.step >= 2:
                    stub.Stop(learner_pb2.StopRequest(reason="test"), timeout=5)
                    return
                time.sleep(0.05)

    watcher = threading.Thread(target=stop_after_step_2, daemon=True)
    watcher.start()
    proc = _learner(stack, "stopped", f"learner.trainer.control_port={control}", "learner.trainer.test_freq=0")
    watcher.join(timeout=10)
    assert proc.returncode == 0, proc.stderr[-6000:]
    done = [r["step"] for r in _steps(root, "stopped")]
    last = done[-1]
    assert done == list(range(1, last + 1)) and 2 <= last < 4, done
    assert (root / "ckpt_stopped" / f"step_{last}").is_dir()

    resumed = _learner(stack, "resumed", f"learner.checkpoint.resume={root / 'ckpt_stopped' / f'step_{last}'}",
                       "learner.trainer.test_freq=0")
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    again = {r["step"]: r for r in _steps(root, "resumed")}
    whole = {r["step"]: r for r in _steps(root, "k2")}
    assert sorted(again) == list(range(last + 1, 5))
    for step in again:
        for key in ("prompt/length_mean", "data/epoch"):
            assert again[step][key] == whole[step][key], (step, key)


def test_replica_killed_mid_run_loses_and_duplicates_nothing(stack):
    """SIGKILL the first replica seen running the learner's requests: the run ends with every step, no reward lost,
    and the survivor serving every group at the end."""
    root = stack["root"]
    cmd = [sys.executable, "-m", "dgrpo.cli", "learner", "--config", str(stack["config"]),
           f"learner.checkpoint.dir={root / 'ckpt_kill'}", "learner.trainer.run_name=kill",
           "learner.trainer.test_freq=0", "learner.rollout.retry_backoff_s=0.2", "learner.rollout.max_backoff_s=1",
           "learner.rollout.step_timeout_s=240",  # with no replica left, fail in minutes rather than hang
           # Long completions keep each burst on the victim's engine for seconds, not the tenths of a second that
           # 24 tokens take: with short ones the 4 steps could end (CI did) before a poll saw a request running.
           "learner.rollout.max_response_length=96"]
    ids = [sampler_info(s.address).replica_id for s in stack["samplers"]]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # Killed while its engine runs the learner's requests (early on, batches ahead are in flight on both
    # replicas): killed between bursts, no stream would fail and the test would prove nothing. Both replicas are
    # watched and the first seen running is the victim: the straggler watch may hedge one replica's first prompts
    # onto the other (one still loading the run's first version), so a fixed victim can go a whole fast run idle.
    channels = [grpc.insecure_channel(s.address) for s in stack["samplers"]]
    try:
        stubs = [sampler_pb2_grpc.SamplerStub(ch) for ch in channels]
        deadline = time.monotonic() + 300
        while True:
            running = [stub.Info(sampler_pb2.InfoRequest(), timeout=10).running_requests for stub in stubs]
            if any(running):
                break
            assert proc.poll() is None, proc.stderr.read()[-6000:]
            assert time.monotonic() < deadline, "no replica ever ran a request"
            time.sleep(0.05)
    finally:
        for ch in channels:
            ch.close()
    victim, survivor = (0, 1) if running[0] else (1, 0)
    survivor_id = ids[survivor]
    stack["samplers"][victim].kill()
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-6000:]
    steps = _steps(root, "kill")
    assert [r["step"] for r in steps] == list(range(1, 5))
    assert all(r["reward/errors"] == 0 and r["staleness/max"] <= 2 for r in steps)
    assert sum(r.get("rollout/failed_calls", 0) for r in steps) >= 1
    assert steps[-1][f"rollout/groups_by_replica/{survivor_id}"] == 2  # the survivor serves every group at the end
